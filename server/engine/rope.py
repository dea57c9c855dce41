"""Per-sequence rope factors for length-dependent rope (LongRoPE: Phi-3, Phi-3.5, Phi-4-mini).

transformers' LongRoPE rotary embedding uses its short factors while the largest position of a
forward pass is below `original_max_position_embeddings` (the switch, `kv.Layout.rope_switch`)
and its long factors past it, for every token of the pass; `generate` recomputes a sequence
from its first token when it crosses the switch (Phi3ForCausalLM.prepare_inputs_for_generation).
kvserve packs many sequences into one pass, so the choice is made per sequence instead: a
sequence's tokens take the long factors when the sequence (its tokens so far, drafts aside) is
longer than the switch, and the engine recomputes a sequence whose cache holds short-factor
keys when it crosses (`Engine._step`). A cache longer than the switch holds long-factor keys,
a shorter one short-factor keys (`kv.Layout.rope_long`; the reuse decision keeps it so).

`install` swaps each LongRoPE rotary module's forward for one that computes both sets of
cos/sin with the module's own forward and picks per token: long where the token's position is
at or past the switch (a decode row there is always long) or where the step says its row is
long (`StepContext.long_tokens`, server/engine/context.py). Calls outside a step
(transformers' own `generate`) run the original forward alone.
"""

from __future__ import annotations

import types

import torch

from server.engine import context


class LongRope:
    """The model's LongRoPE rotary modules, switched per sequence during kvserve's steps."""

    def __init__(self, switch: int) -> None:
        self.switch = switch


def install(model, switch: int | None) -> LongRope | None:
    """Make `model`'s LongRoPE rotary modules choose their factors per token in kvserve's
    steps; None when the model has none (`switch` None)."""
    if switch is None:
        return None
    installed = getattr(model, "_kvserve_rope", None)
    if installed is not None and installed.switch == switch:
        return installed
    modules = longrope_modules(model)
    if not modules:
        raise ValueError(f"a rope switch at {switch} but no LongRoPE rotary module in {type(model).__name__}")
    rope = LongRope(switch)
    for module in modules:
        _patch(module, rope)
    model._kvserve_rope = rope
    return rope


def longrope_modules(model) -> list[torch.nn.Module]:
    """The rotary modules of `model` whose rope type is LongRoPE."""
    return [m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"]


def _patch(module: torch.nn.Module, rope: LongRope) -> None:
    """In a step, run the module's own forward twice, so that whatever it derives from the
    largest position of the pass (factors, attention scaling) is what transformers computes
    for a sequence of that kind: once with every position below the switch (the short
    factors; positions at or past it, which are always long, are replaced), once with the
    switch position appended (the long factors; its row dropped). Then pick per token."""
    original = module.forward  # bound: transformers' decorated forward

    def forward(self, x, position_ids, *args, **kwargs):
        step = context.current()
        if step is None:
            return original(x, position_ids, *args, **kwargs)
        take_long = position_ids >= rope.switch  # [1, N]
        if step.long_tokens is not None:
            take_long = take_long | step.long_tokens
        n = position_ids.shape[-1]
        cos_short, sin_short = original(x, position_ids.masked_fill(take_long, 0), *args, **kwargs)
        beyond = torch.full_like(position_ids[..., :1], rope.switch)
        cos_long, sin_long = original(x, torch.cat([position_ids, beyond], dim=-1), *args, **kwargs)
        take_long = take_long[..., None]
        return torch.where(take_long, cos_long[..., :n, :], cos_short), torch.where(take_long, sin_long[..., :n, :], sin_short)

    module.forward = types.MethodType(forward, module)
