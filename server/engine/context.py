"""One step's context: what the layer patches need to know about the step running now.

kvserve runs transformers' own modeling code with some of its modules' forwards replaced
(`model_runner.PATCHES` installs them, in order): the attention function, LongRoPE's rotary
modules, the recurrent layers of a hybrid, the LoRA deltas and exact mode's linear and norm
layers. What each needs of the step (whose tokens these are, which adapter or state slot each
token has, whether exact numerics are on) is in one `StepContext`, built once per step by the
model runner and entered in one place: `ModelRunner._forward`, the body that eager steps and
CUDA graph capture both run. A patch reads `current()`; outside a step (transformers' own
`generate`, the families probe's reference) it is None and every patched module runs as it was.

NOTE: one slot per thread: the engine thread runs the steps, and tests may run a second
engine (or transformers' own forward) on another thread at the same time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from server.engine.attention import Batch, Row
    from server.engine.recurrent import StepRows

_local = threading.local()


@dataclass(slots=True)
class StepContext:
    """Who the step's flattened tokens [N] belong to, and how they are computed.

    `batches`: the paged path's batches (decode rows first in the flattened batch, one token
    each); `rows`: the row path's rows. `exact`: exact mode's numerics (server/engine/exact.py)
    for attention, the linear and the norm layers. `long_tokens` [N] bool: the tokens that take
    LongRoPE's long factors before the switch (server/engine/rope.py; None: by position).
    `adapters` [N]: each token's LoRA adapter slot (server/engine/lora.py; None: the base
    everywhere). `recurrent`: a hybrid's rows and state slots (server/engine/recurrent.py), whose
    writes are stored when the step's forward has run whole (`entered`). `observe(layer, key,
    value)`: called before each layer attends (families.check's probe). `memo`: what a patch
    computes once per step and reuses in every layer (masks, a shared product), keyed by its
    owner; it starts empty each time the context is entered.
    """

    rows: list[Row] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    exact: bool = False
    long_tokens: torch.Tensor | None = None
    adapters: torch.Tensor | None = None
    recurrent: StepRows | None = None
    observe: Callable[[int, torch.Tensor, torch.Tensor], object] | None = None
    memo: dict = field(default_factory=dict)


def current() -> StepContext | None:
    """The context of the step running on this thread (None outside kvserve's steps)."""
    return getattr(_local, "context", None)


def exact() -> bool:
    """Whether the step running on this thread computes in exact mode."""
    context = current()
    return context is not None and context.exact


@contextlib.contextmanager
def entered(context: StepContext) -> Iterator[StepContext]:
    """Run the forward passes inside as `context`'s step. On leaving, a hybrid's recurrent
    writes are stored if the body finished (a step that fails half-way leaves every state as
    it was; the engine retries it smaller) and its trash slot is cleared either way.

    Side effect: inside a CUDA graph capture these stores are part of the graph."""
    before = current()
    context.memo.clear()
    _local.context = context
    finished = False
    try:
        yield context
        finished = True
    finally:
        _local.context = before
        context.memo.clear()
        if context.recurrent is not None:
            context.recurrent.finish(stored=finished)
