"""The forward pass around one sequence's StaticCache, and token choice from its logits.

Shapes: input_ids [1, T] (T = a prefill chunk, or 1 when decoding); cache_position [T], the
absolute positions of those tokens; the model returns logits [1, 1, V] for the last position only
(`logits_to_keep=1`), handed back as a float32 [V] tensor.
"""

from __future__ import annotations

import torch

from server.sampling import process_logits, sample, top_logprobs
from server.sequence import Sequence, TokenInfo


@torch.inference_mode()
def forward(model, cache, token_ids: list[int], start: int) -> torch.Tensor:
    """Run `token_ids` at positions start.. through the model, writing their KV into `cache`."""
    device = model.device
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(token_ids), device=device)
    out = model(
        input_ids=input_ids,
        past_key_values=cache,
        cache_position=positions,
        position_ids=positions.unsqueeze(0),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[0, -1].float()


def advance(model, seq: Sequence, chunk: int) -> torch.Tensor | None:
    """Compute up to `chunk` pending tokens of `seq`; logits once nothing is pending, else None.

    Side effect: writes their KV into `seq.cache` and moves `seq.n_computed` forward.
    """
    pending = seq.pending_ids[:chunk]
    logits = forward(model, seq.cache, pending, seq.n_computed)
    seq.n_computed += len(pending)
    return None if seq.pending_ids else logits


def choose(seq: Sequence, logits: torch.Tensor) -> TokenInfo:
    """Pick the next token of `seq` from raw logits; logprobs are the model's own (unbiased)."""
    params = seq.params
    if params.uses_penalties and seq.counts is None:
        seq.counts = torch.zeros(logits.shape[-1], dtype=torch.int32)
    processed = process_logits(logits, params, seq.counts)
    token_id = sample(processed, params, seq.generator)
    if seq.counts is not None:
        seq.counts[token_id] += 1
    if not params.logprobs:
        return TokenInfo(token_id)
    logprobs = torch.log_softmax(logits, dim=-1)
    return TokenInfo(
        token_id,
        logprob=float(logprobs[token_id]),
        top=top_logprobs(logprobs, params.top_logprobs),
    )
