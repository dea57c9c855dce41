"""A hybrid model's recurrent layers (linear attention, Mamba, short convolutions) under kvserve's
step: each sequence's state lives in the pool's state slots (cache_manager/state.py), and the
layer runs transformers' own code per sequence.

kvserve packs a step's rows into one flattened batch of tokens [1, N] (server/engine/attention.py);
attention keeps the rows apart by its block tables, but a recurrent layer would run one state
through every row's tokens. So `enable` wraps each recurrent module's forward: during a step it
cuts the flattened tokens back into rows and calls the module's own forward

* once for all decode rows together ([B, 1, D]: one token each, each continuing its state),
* once per multi-token row ([1, n, D]: a prompt or a chunk of one, from its state or from none),

each time with `_RowStates` as the module's cache: transformers' cache interface
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`,
`has_previous_state`, `is_recording_past`) over those rows' slots, with the same semantics as
transformers' `LinearAttentionLayer`; what the module wrote goes back to the slots afterwards.
The forward a step runs is `state.state_forward(module)`: the module's own, or kvserve's for a
block that keeps its state outside transformers' cache interface (RecurrentGemma's, MiniMax's). Outside a step (transformers' own
`generate`, the families probe's reference) the module runs as it was. Padding rows of a decode bucket use the trash slot, zeroed after the step.

Jamba's Mamba mixer runs a multi-token input through `mamba_selective_scan`, which starts from a
zero state (as mamba_ssm's kernel does): `generate` never gives it a state (a prompt, then one
token at a time), but kvserve does, for a prompt's later chunks and a session's next turn. So
`enable` replaces that function in the model's module with `_scan`, which runs the same
recurrence from the row's kept state while `_wrapped` passes it one (`_INITIAL`), and is the
original otherwise.
"""

from __future__ import annotations

import contextvars
import inspect
import sys

import torch
import torch.nn.functional as F

from cache_manager import state
from cache_manager.state import Slots
from server.engine import context
from server.engine.context import StepRows

def step_inputs(slots: Slots, segments: list[tuple[int, int, int, bool]]):
    """A step's rows for the recurrent layers, `segments` per row (offset in the flattened
    tokens, tokens, slot, has a state): the host list of their device inputs (decode rows'
    offsets and slots, the other rows' slots), which travels with the step's other inputs in
    its one host-to-device copy, and how to build the `StepRows` from it once there."""
    decode = [(off, slot) for off, n, slot, prev in segments if n == 1 and prev]
    others = [(off, n, prev) for off, n, _, prev in segments if not (n == 1 and prev)]
    b = len(decode)
    contiguous = [off for off, _ in decode] == list(range(b))
    host = [off for off, _ in decode] + [slot for _, slot in decode] + [slot for off, n, slot, prev in segments if not (n == 1 and prev)]

    def build(flat: torch.Tensor) -> StepRows:
        return StepRows(
            slots,
            None if contiguous else flat[:b],
            flat[b : 2 * b] if b else None,
            [(off, n, flat[2 * b + j : 2 * b + j + 1], prev) for j, (off, n, prev) in enumerate(others)],
        )

    return host, build


def decode_rows(slots: Slots, state_slots: torch.Tensor) -> StepRows:
    """A pure decode step's rows (tokens 0..B-1, each continuing its state) whose slots are
    `state_slots` [B]: a view of the model runner's persistent buffer, so a captured CUDA
    graph reads each replay's slots and writes their states back."""
    return StepRows(slots, None, state_slots, [])


def enable(model) -> int:
    """Wrap every recurrent module's forward (once); returns how many there are."""
    modules = state.recurrent_modules(model)
    for module, keyword in modules:
        if not getattr(module, "_kvserve_recurrent", False):
            module.forward = _wrapped(module, state.state_forward(module), keyword, module.forward)
            module._kvserve_recurrent = True
    return len(modules)


_SCAN = "mamba_selective_scan"  # a Mamba mixer's whole-input scan, from a zero state (the module docstring)
_INITIAL: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("kvserve_initial_state", default=None)


def _scans_from_zero(module) -> bool:
    """Whether the module's multi-token form runs `_SCAN` (and so ignores a kept state); if so,
    its modeling module's `_SCAN` is `_scan` from here on."""
    owner = sys.modules[type(module).__module__]
    original = getattr(owner, _SCAN, None)
    if original is None or _SCAN + "(" not in inspect.getsource(inspect.unwrap(type(module).forward)):
        return False
    if getattr(module, "n_mamba_heads", 1) != 1:  # Zamba scans each head's slice of the state: not this shape
        return False
    if not getattr(original, "_kvserve_scan", False):
        setattr(owner, _SCAN, _scan(original))
    return True


def _scan(original):
    """`original` (`_SCAN`), or, under `_INITIAL`, the same selective scan from that state:
    hidden_states and dt [b, d, t], A [d, n], B and C [b, n, t]; the output [b, d, t] and, with
    `return_last_state`, the state after the last token [b, d, n]."""

    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False, **kwargs):
        initial = _INITIAL.get()
        if initial is None:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                            return_last_state=return_last_state, **kwargs)
        dtype = hidden_states.dtype
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        decay = torch.exp(A[None, :, None, :] * dt[..., None])  # [b, d, t, n]
        inputs = dt[..., None] * B.transpose(1, 2)[:, None].float() * hidden_states[..., None].float()
        readout = C.transpose(1, 2)  # [b, t, n]
        ssm = initial.float()  # as the scan's own state and the decode update keep it, whatever the activations' dtype
        outputs = []
        for t in range(hidden_states.shape[-1]):
            ssm = decay[:, :, t] * ssm + inputs[:, :, t]
            outputs.append(torch.matmul(ssm.to(dtype), readout[:, t, :, None])[..., 0])
        out = torch.stack(outputs, dim=-1)
        if D is not None:
            out = out + hidden_states * D[None, :, None]
        if z is not None:
            out = out * F.silu(z)
        return (out, ssm) if return_last_state else out

    scan._kvserve_scan = True
    return scan


def _wrapped(module, original, keyword: str, plain):
    """`module`'s forward: `plain` (its own) outside a step; in one, `original`
    (`state.state_forward`) per row as the module docstring says."""
    named = [p.name for p in inspect.signature(original).parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    first = named[0]
    from_zero = _scans_from_zero(module)

    def forward(*args, **kwargs):
        step = context.current()
        rows = step.recurrent if step is not None else None
        if rows is None:
            return plain(*args, **kwargs)
        hidden = args[0] if args else kwargs.pop(first)
        # NOTE: only the module's own parameters: the step's other keywords (the mask) are not
        # its business, and no row is padded.
        extra = {k: v for k, v in kwargs.items() if k in named and k not in (keyword, "attention_mask", first)}
        out, paired = None, False

        def run(x, states):  # the output; a forward that returns (output, something) gives the first
            nonlocal paired
            y = original(x, **extra, **{keyword: states})
            paired = isinstance(y, tuple)
            return y[0] if paired else y

        if rows.decode_slots is not None:
            offsets = rows.decode_offsets
            x = hidden[0, : len(rows.decode_slots)] if offsets is None else hidden[0].index_select(0, offsets)
            states = _RowStates(rows.slots, rows.decode_slots, True)
            y = run(x[:, None], states)
            rows.written += states.written()
            out = hidden.new_empty((1, hidden.shape[1], y.shape[-1]))
            if offsets is None:
                out[0, : y.shape[0]] = y[:, 0]
            else:
                out[0].index_copy_(0, offsets, y[:, 0])
        for offset, n, slot, prev in rows.others:
            states = _RowStates(rows.slots, slot, prev)
            kept = _INITIAL.set(states.get_recurrent_state(module.layer_idx) if from_zero and prev else None)
            try:
                y = run(hidden[:, offset : offset + n], states)
            finally:
                _INITIAL.reset(kept)
            rows.written += states.written()
            if out is None:
                out = hidden.new_empty((1, hidden.shape[1], y.shape[-1]))
            out[:, offset : offset + n] = y
        return (out, None) if paired else out

    return forward


class _RowStates:
    """transformers' cache interface for a recurrent layer over some rows' state slots (the
    module docstring): reads gather the slots, writes stay here until `write_back`."""

    def __init__(self, slots: Slots, index: torch.Tensor, previous: bool) -> None:
        self.slots, self.index, self.previous = slots, index, previous
        self._read: dict[str, torch.Tensor] = {}
        self._written: dict[str, torch.Tensor] = {}

    def _name(self, kind: str, layer_idx: int, state_idx: int) -> str:
        return f"{kind}.{layer_idx}.{state_idx}"

    def _get(self, name: str) -> torch.Tensor:
        if name in self._written:
            return self._written[name]
        if name not in self._read:
            self._read[name] = self.slots.get(name, self.index)
        return self._read[name]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.previous

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(self._name("conv", layer_idx, state_idx)) if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(self._name("rec", layer_idx, state_idx)) if self.previous else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The new inputs after the kept ones (none on a first chunk, left-padded to the
        kernel when shorter); keeps the last kernel-width of them."""
        name = self._name("conv", layer_idx, state_idx)
        width = self.slots.tensors[name].shape[-1]
        if self.previous:
            full = torch.cat([self._get(name), conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < width:
                full = F.pad(full, (width - full.shape[-1], 0), value=0)
        self._written[name] = full[..., -width:].to(self.slots.tensors[name].dtype)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        name = self._name("rec", layer_idx, state_idx)
        self._written[name] = recurrent_states.to(self.slots.tensors[name].dtype)
        return self._written[name]

    def written(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """What the layer left, to store in the slots: written states, and read ones it may
        have updated in place (a decode step's conv kernel does)."""
        return [(name, self.index, t) for name, t in {**self._read, **self._written}.items()]
