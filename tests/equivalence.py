"""The equivalence rule of docs/architecture.md, shared by the tests that compare outputs:
greedy tokens are identical, or the first differing step is a near-tie (logit gap < 1e-4
between the top two logits, after the grammar mask where there is one)."""

from __future__ import annotations

import torch

from cache_manager import kv
from server.engine.model_runner import forward

NEAR_TIE = 1e-4


def divergence_gap(model, prompt: list[int], got: list[int], want: list[int], grammar=None) -> float:
    """The top-two logit gap of a fresh prefill at the first step where `got` leaves `want`."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    ids = prompt + want[:i]
    cache = kv.allocate(model.config, len(ids) + 256, model.device, model.dtype)
    logits = forward(model, cache, ids, 0)
    if grammar is not None:
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(want[:i])
        matcher.apply_mask(logits)
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_equivalent(model, prompt: list[int], got: list[int], want: list[int], grammar=None) -> None:
    if got != want:
        gap = divergence_gap(model, prompt, got, want, grammar)
        assert gap < NEAR_TIE, f"outputs diverge with logit gap {gap}: {got} != {want}"
