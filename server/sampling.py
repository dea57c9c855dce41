"""Sampling as small pure functions over one sequence's logits.

Shapes: `logits` is a float32 tensor [vocab]; `counts` is an int tensor [vocab] with how often
each token was generated so far (for the penalties). Every function returns a new tensor or
modifies only what it is documented to modify.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    """What the engine needs to pick tokens; built by the HTTP layer from the wire request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError("temperature must be in [0, 2]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 <= self.top_logprobs <= 20):
            raise ValueError("top_logprobs must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request CPU generator: the same seed gives the same draws whatever else runs."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % (2**63))
    return generator


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if not bias:
        return logits
    ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, values)


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's definition: logit -= presence * [count > 0] + frequency * count."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, -math.inf)


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (at least one)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # A token is dropped when the mass before it already reaches top_p.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def process_logits(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None
) -> torch.Tensor:
    """Bias and penalties, the parts that also change greedy choices."""
    logits = apply_logit_bias(logits, params.logit_bias)
    if counts is not None:
        logits = apply_penalties(logits, counts, params.presence_penalty, params.frequency_penalty)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from processed logits: argmax when greedy, else a seeded draw."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits / params.temperature
    logits = filter_top_k(logits, params.top_k)
    logits = filter_top_p(logits, params.top_p)
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator).item())


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return list(zip(ids.tolist(), values.tolist()))
