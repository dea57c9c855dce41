"""One batched forward pass for a step's plan, and token choice from its logits.

Shapes: the plan's rows are packed into one flattened batch of N tokens (see cache_manager/kv.py
for the layout); `run` returns float32 logits [R, vocab], one row per plan row that `completes`
(its last pending token was computed), in plan order; a row carrying a draft of k tokens
(server/speculative.py) has k + 1 consecutive logits rows instead: at its pending token and at
each drafted one.
"""

from __future__ import annotations

import torch

from cache_manager import kv
from server.sampling import process_logits, sample_rows, top_logprobs
from server.scheduler import Plan
from server.sequence import Sequence, TokenInfo


def run(model, plan: Plan) -> torch.Tensor:
    """Compute every row's scheduled tokens in one forward pass.

    Side effect: writes their KV into each sequence's cache (its length moves forward, drafted
    tokens included: postprocess crops the rejected ones).
    """
    rows, token_ids, logits_rows, counts = [], [], [], []
    for i, row in enumerate(plan.rows):
        drafted = row.draft.tokens if row.draft is not None else []
        rows.append(kv.Row(row.seq.cache, row.n_tokens + len(drafted)))
        token_ids += row.seq.pending_ids(row.n_tokens) + drafted
        if row.completes:
            logits_rows.append(i)
            counts.append(1 + len(drafted))
    return kv.forward(model, rows, token_ids, logits_rows, counts)


def forward(model, cache, token_ids: list[int], start: int) -> torch.Tensor:
    """One sequence alone: `token_ids` at positions start.. (= the cache's length), written into
    `cache`; float32 logits [vocab] at the last one."""
    if start != kv.length(cache):
        raise ValueError(f"the cache holds {kv.length(cache)} tokens, not {start}")
    return kv.forward(model, [kv.Row(cache, len(token_ids))], token_ids, [0])[0]


def choose(seqs: list[Sequence], logits: torch.Tensor) -> list[TokenInfo]:
    """The next token of each sequence from its row of raw logits [R, vocab].

    Logprobs are the model's own distribution (before grammar masks, bias and penalties).
    Side effects: grammar masks are added to `logits` in place; penalty counts move forward.
    """
    logprobs = {i: torch.log_softmax(logits[i], dim=-1) for i, s in enumerate(seqs) if s.params.logprobs}
    for i, seq in enumerate(seqs):
        if seq.matcher is not None:
            seq.matcher.apply_mask(logits[i])
        row = logits[i]
        if (done := processed(seq, row)) is not row:
            logits[i] = done
    token_ids = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
    return [taken(seq, token_id, logprobs.get(i)) for i, (seq, token_id) in enumerate(zip(seqs, token_ids))]


def processed(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """One position's logits [vocab] after the request's logit bias and penalties (`logits`
    itself when it has neither); a request with penalties starts counting its tokens here."""
    params = seq.params
    if params.uses_penalties and seq.counts is None:
        seq.counts = torch.zeros(logits.shape[-1], dtype=torch.int32, device=logits.device)
    if params.logit_bias or seq.counts is not None:
        return process_logits(logits, params, seq.counts)
    return logits


def taken(seq: Sequence, token_id: int, logprobs: torch.Tensor | None) -> TokenInfo:
    """The token chosen at one position, counted for penalties; with the position's
    log-softmax [vocab] (when the request asks for logprobs), its logprob and top ones."""
    if seq.counts is not None:
        seq.counts[token_id] += 1
    if logprobs is None:
        return TokenInfo(token_id)
    return TokenInfo(token_id, logprob=float(logprobs[token_id]), top=top_logprobs(logprobs, seq.params.top_logprobs))
