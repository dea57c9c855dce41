"""One step's context: what the layer patches need to know about the step running now.

kvserve runs transformers' own modeling code with some of its modules' forwards replaced
(`model_runner.PATCHES` installs them, in order): the attention function, LongRoPE's rotary
modules, the recurrent layers of a hybrid, Llama 4's query temperature, the LoRA deltas and
exact mode's linear and norm layers. What each needs of the step (whose tokens these are,
which adapter or state slot each token has, whether exact numerics are on) is in one
`StepContext`, built once per step by the model runner and entered in one place:
`ModelRunner._forward`, the body that eager steps and CUDA graph capture both run. A patch reads `current()`; outside a step (transformers' own
`generate`, the families probe's reference) it is None and every patched module runs as it was.

The step's parts live here too, so that the patches import the step and never each other:
the row path's `Row`s and the paged path's `Batch`es (server/engine/attention.py attends them)
and a hybrid's `StepRows` (server/engine/recurrent.py runs them).

NOTE: one slot per thread: the engine thread runs the steps, and tests may run a second
engine (or transformers' own forward) on another thread at the same time.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cache_manager import kv
from cache_manager.state import Slots

_local = threading.local()


@dataclass(slots=True)
class Row:
    """One sequence's part of a step on the row path: `n` new tokens at positions
    kv.length.. (offset: where they start in the flattened batch). `shift`: how far their
    rope positions run from those (a picture's M-RoPE grid before them: server/engine/vision.py).
    """

    kv: kv.SequenceKV
    n: int
    offset: int = 0
    shift: int = 0
    grid: list[list[int]] | None = None  # its tokens' 3-D rope positions where a picture's grid is among them (vision.rope_positions)
    reach: list[int] | None = None  # the last position each token sees (a whole picture's: vision.reach); None: its own
    slots: torch.Tensor | None = None  # slot of every position 0..length+n-1, when gathered
    masks: dict = field(default_factory=dict)  # window -> the row's additive mask


class Batch:
    """The paged path's per-step tensors for B rows of up to T (`width`) new tokens each, on
    the pool's device: `slots` [B * T] (where each token's key/value goes: the trash block for
    padding tokens), `tables` [B, max_blocks] (block tables, trash block past a row's end),
    `positions` [B * T] (each token's position; a padding token repeats its row's last one).
    `tokens` [B * T]: each token's index in the step's flattened batch (padding tokens: any);
    None for decode rows (T = 1), which come first in the flattened batch. `real` [R]: which of
    the B * T are real tokens (None: all). `reach` [B * T]: the last position each token sees
    (None: its own). `prepare` derives the gather index and the masks; in a CUDA graph these
    are persistent buffers, refilled before each replay. `kernel`: the rows attend through the
    paged attention kernel (server/engine/paged_kernel.py), which reads the pool in place by
    block table: no gather index, no masks."""

    def __init__(self, pool: kv.Pool, slots: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                 width: int = 1, tokens: torch.Tensor | None = None, real: torch.Tensor | None = None, kernel: bool = False,
                 reach: torch.Tensor | None = None) -> None:
        self.pool, self.slots, self.tables, self.positions = pool, slots, tables, positions
        self.width, self.tokens, self.real, self.reach = width, tokens, real, reach
        self.kernel = kernel
        self.token_slots: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None  # tokens[real]: where the real outputs go
        self.masks: dict[int | None, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return self.tables.shape[0]

    def prepare(self, dtype: torch.dtype, groups: int) -> None:
        """The gather index [B, L] and one additive mask [B, 1, groups * T, L] per window:
        what a query sees (`visible`), and where the real tokens' outputs go. Device ops only:
        this runs inside graph capture. No index and no masks for the kernel's rows."""
        if self.tokens is not None:
            self.targets = self.tokens if self.real is None else self.tokens[self.real]
        if self.kernel:
            return
        bs = self.pool.block_size
        offsets = torch.arange(bs, device=self.tables.device)
        self.token_slots = (self.tables[:, :, None] * bs + offsets).flatten(1)
        keys = torch.arange(self.token_slots.shape[1], device=self.tables.device)[None, None, :]
        queries = self.positions.view(self.size, self.width, 1)
        reach = None if self.reach is None else self.reach.view(self.size, self.width, 1)
        self.masks = {}
        for window in set(self.pool.layout.windows):
            mask = additive(visible(keys, queries, window, reach), dtype)
            # a KV head's query heads side by side, as `_attend_batch` folds them (one query
            # per row: the same mask for each, broadcast)
            self.masks[window] = (mask.repeat(1, groups, 1) if self.width > 1 else mask)[:, None]


@dataclass
class StepRows:
    """A step's rows as the recurrent layers see them: the decode rows' slots ([B] on the
    device) and their token offsets (None: tokens 0..B-1, a pure decode step), and per other
    row (offset, tokens, slot [1], whether it has a state)."""

    slots: Slots
    decode_offsets: torch.Tensor | None
    decode_slots: torch.Tensor | None
    others: list[tuple[int, int, torch.Tensor, bool]]
    # what the layers wrote, stored once the whole forward pass has run: a pass that fails
    # half-way (retried smaller by the engine) leaves every state as it was
    written: list = field(default_factory=list)

    def finish(self, stored: bool) -> None:
        """The step's forward has ended: store what the layers wrote if it ran whole
        (`stored`), and clear the trash slot the padding rows wrote either way."""
        if stored:
            for name, index, values in self.written:
                self.slots.put(name, index, values)
        self.written.clear()
        self.slots.clear_trash()


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
    value)`: called before each layer attends (families.check's probe). `deepstack`: the step's
    picture positions [1, N] bool and, per deepstack layer, their feature rows [M, hidden] in
    position order (Qwen3-VL: added to the first layers' output, server/engine/vision.py).
    `positions` [1, N]: the tokens' rope positions (set where the step's forward runs; None
    for M-RoPE's 3-D ones), which Llama 4's query temperature reads (server/engine/temperature.py).
    `memo`: what a patch
    computes once per step and reuses in every layer (masks, a shared product), keyed by its
    owner; it starts empty each time the context is entered. `opaque`: each layer attends
    the step's batches in one opaque op (`attention.step_attention`): a compiled step of more
    than decode rows, whose graph then depends on no batch (server/engine/compiled.py). `pool`:
    the KV pool the step's rows live in.
    """

    rows: list[Row] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    exact: bool = False
    long_tokens: torch.Tensor | None = None
    adapters: torch.Tensor | None = None
    recurrent: StepRows | None = None
    observe: Callable[[int, torch.Tensor, torch.Tensor], object] | None = None
    deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    positions: torch.Tensor | None = None
    memo: dict = field(default_factory=dict)
    opaque: bool = False
    pool: kv.Pool | None = None


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


def step_forward(module: torch.nn.Module, make) -> bool:
    """Give `module` the forward `make(module, original)`, which runs inside kvserve's steps
    (once: a forward already replaced, by this patch or another, is kept); whether the forward
    it has now is `make`'s."""
    if "forward" not in vars(module):
        module.forward = make(module, module.forward)
        module.forward._kvserve_made_by = make
    return getattr(module.forward, "_kvserve_made_by", None) is make


def visible(keys: torch.Tensor, queries: torch.Tensor, window: int | None, reach: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query sees, by position (broadcast): those at or before its own (or its
    `reach`: a picture that attends to itself whole, server/engine/vision.py) and, with a
    sliding window (> 0), after its own - window (transformers' rule), or with a chunked one
    (< 0, `kv.Layout`), from its chunk's first on. The one causal rule of every torch attention
    path; the Triton kernels write it in their own terms (`first_visible` there)."""
    allowed = keys <= (queries if reach is None else reach)
    if window is not None:
        allowed &= keys >= first_visible(queries, window)
    return allowed


def first_visible(position, window: int | None):
    """The first key position a query at `position` (an int or a tensor) sees under `window`
    (`kv.Layout`), unclamped: a sliding window's may be negative."""
    if window is None:
        return position * 0
    if window > 0:
        return position - window + 1
    return position - position % -window


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as an additive one: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)
