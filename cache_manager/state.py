"""Recurrent state beside the KV pool, for hybrid models (Qwen3-Next, Granite 4.0-H, Falcon-H1,
LFM2, Jamba, MiniMax, RecurrentGemma...) and pure state-space ones (Mamba): layers of linear
attention, Mamba, RG-LRU or short convolutions keep a fixed-size state per sequence instead of
keys and values that grow with it. Families that keep it outside transformers' cache interface
(in a cache class of their own, or on the module itself) are brought to it here
(`state_forward`).

* `Spec`: what one sequence's state is, found by running the model's own code once on the meta
  device with transformers' cache (no memory, no weights): per layer and state index a conv
  state and/or a recurrent state, each with its shape and dtype (fp32 where the model keeps it
  so). None for a model without such layers.
* `Slots`: the states of `num_slots` sequences, allocated once on the pool's device, one tensor
  per named state with the slot first: [num_slots + 1, ...]. The last slot is the trash slot
  that padding rows of a bucket read and write (zeroed again after each step). A sequence holds
  one slot while it lives (`kv.SequenceKV.state`); a slot's contents are the state after the
  sequence's `length` tokens and nothing else: a recurrent state cannot be cut back, so a cache
  holding one can only be kept whole or recomputed (`kv.can_crop`).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cache_manager.blocks import NoBlocks

__all__ = ["NoSlots", "Slots", "Spec", "spec"]


class NoSlots(NoBlocks):
    """Every state slot is taken."""


@dataclass(frozen=True)
class Spec:
    """Per named state ("conv.<layer>.<index>", "rec.<layer>.<index>"): one sequence's shape
    and dtype. `layers`: the model layers that keep state."""

    shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({int(name.split(".")[1]) for name, _, _ in self.shapes}))

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        return sum(_numel(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in self.shapes)

    def describe(self) -> str:
        return f"{len(self.layers)} recurrent layers, {self.nbytes} bytes per sequence"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def spec(config, dtype: torch.dtype) -> Spec | None:
    """The recurrent state of a model of `config` computing in `dtype` (None without recurrent
    layers). Runs the model's own code once on the meta device; cached per config."""
    key = (config.to_json_string(use_diff=False), dtype)
    if key not in _SPECS:
        _SPECS[key] = _spec(config, dtype)
    return _SPECS[key]


_SPECS: dict[tuple[str, torch.dtype], Spec | None] = {}


def _spec(config, dtype: torch.dtype) -> Spec | None:
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    if not any(t in RECURRENT_TYPES for t in get_layer_types_and_kwargs(text)[0]):
        return None
    # NOTE: the recurrent modules alone, on three tokens of zeros: the rest of the model (an
    # MoE's grouped products, say) need not run on the meta device
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        cache = DynamicCache(config=text)
        hidden = torch.zeros(1, 3, text.hidden_size, dtype=dtype, device="meta")
        with torch.inference_mode():
            for module, keyword in recurrent_modules(model):
                state_forward(module)(hidden, **{keyword: cache})
    except Exception:  # noqa: BLE001 - a state kept some other way kvserve does not know: none it can hold
        return Spec(())
    shapes = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for s in range(layer.number_of_states):
            for kind, t in (("conv", layer.conv_states[s]), ("rec", layer.recurrent_states[s])):
                if t is not None:
                    shapes.append((f"{kind}.{i}.{s}", tuple(t.shape[1:]), t.dtype))
    return Spec(tuple(shapes))


_STATE_CALLS = ("get_conv_state(", "get_recurrent_state(", "update_conv_state(", "update_recurrent_state(")


def recurrent_modules(model) -> list[tuple[torch.nn.Module, str]]:
    """The modules that keep a recurrent state through transformers' cache interface (their
    code calls it, or `state_forward` is theirs), with the keyword their cache comes in
    (`cache_params`, `past_key_values`)."""
    import inspect

    found = []
    for name, module in model.named_modules():
        if type(module).__name__ in _OWN_FORWARDS:
            module.layer_idx = _layer_of(name)  # its decoder layer's (RecurrentGemma's block is not told its index)
            found.append((module, "past_key_values"))
            continue
        if not hasattr(module, "layer_idx"):
            continue
        forward = inspect.unwrap(type(module).forward)
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            continue
        if not any(call in source for call in _STATE_CALLS):
            continue
        params = inspect.signature(forward).parameters
        keyword = next((p for p in ("cache_params", "past_key_values") if p in params), None)
        if keyword is not None:
            found.append((module, keyword))
    return found


def state_forward(module):
    """The forward that keeps `module`'s state through transformers' cache interface: its own,
    or kvserve's for a family that keeps it elsewhere (`_OWN_FORWARDS`: on the module itself,
    in a cache class of its own)."""
    own = _OWN_FORWARDS.get(type(module).__name__)
    return module.forward if own is None else functools.partial(own, module)


def _layer_of(name: str) -> int:
    """The decoder layer index in a module's dotted name ("model.layers.3.temporal_block": 3)."""
    parts = name.split(".")
    return int(next(b for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()))


def _griffin(block, input_states: torch.Tensor, past_key_values) -> tuple[torch.Tensor, None]:
    """RecurrentGemma's recurrent block (Griffin's: a short convolution, then the RG-LRU), its
    state kept through the cache interface: transformers keeps it on the module itself
    (`conv1d_state`, `rg_lru.recurrent_states`), for one batch at a time. The same computation
    as the block's own forward: a first chunk convolves from zeros and resets the recurrence
    at its first token; one more token takes transformers' decoding formula; a longer chunk
    after a kept state (a prompt's later chunk, a session's next turn, which `generate` never
    runs) convolves over the kept inputs and scans on from the kept state."""
    cache, layer, width = past_key_values, block.layer_idx, block.conv1d_width
    t = input_states.shape[1]
    previous = cache.has_previous_state(layer)
    y = block.act_fn(block.linear_y(input_states))
    x = block.linear_x(input_states).transpose(1, 2)  # [B, lru_width, T]
    full = cache.update_conv_state(x, layer, conv_kernel_size=width)
    if not previous:
        x = block.conv_1d(x)[..., :t]
    elif t == 1:
        x = (torch.sum(full[..., -width:] * block.conv_1d.weight[:, 0, :], dim=-1) + block.conv_1d.bias).unsqueeze(-1)
    else:
        x = F.conv1d(full[..., -(t + width - 1):], block.conv_1d.weight, block.conv_1d.bias, groups=block.conv_1d.groups)
    # NOTE: the RG-LRU reads and leaves its state on itself: a shallow copy per call (its
    # parameters shared) keeps transformers' own state, and another thread's forward, apart
    lru = copy.copy(block.rg_lru)
    lru.recurrent_states = cache.get_recurrent_state(layer) if previous else None
    # the recurrence resets where the position is 0: a sequence's first token
    positions = torch.arange(t, device=x.device).expand(x.shape[0], t) + int(previous)
    x = lru(x.transpose(1, 2), positions)
    cache.update_recurrent_state(lru.recurrent_states, layer)
    return block.linear_out(x * y), None


def _lightning(attention, hidden_states: torch.Tensor, past_key_values) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax's lightning attention (linear attention with a per-head decay), its state (K^T V,
    decayed) kept through the cache interface as recurrent state 0: transformers keeps it in a
    cache class of its own (`get_linear_cache`). The same computation as its own forward: a
    first chunk in blocks of `block_size` from a zero state, a decode step by its one-token
    recurrence; a longer chunk after a kept state (which `generate` never runs, and which
    transformers' own code would take one token at a time) in blocks from the kept state."""
    cache, layer = past_key_values, attention.layer_idx
    b, t, _ = hidden_states.shape
    heads, dim = attention.num_attention_heads, attention.head_dim
    qkv = attention.act_fn(attention.qkv_proj(hidden_states)).reshape(b, t, heads, 3 * dim)
    query, key, value = (x.transpose(1, 2) for x in torch.split(qkv, dim, dim=3))
    kept = cache.get_recurrent_state(layer)  # None before the first (transformers' has_previous_state follows a conv state)
    if kept is not None and t == 1:
        kv_state = torch.exp(-attention.slope_rate) * kept + torch.matmul(key.transpose(-1, -2), value)
        out = torch.matmul(query, kv_state)
    else:
        kv_state = kept if kept is not None else torch.zeros(b, heads, dim, dim, device=value.device, dtype=value.dtype)
        pieces = []
        for start in range(0, t, attention.block_size):
            end = min(start + attention.block_size, t)
            n = end - start
            q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
            intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * attention.diagonal_decay[:, :, :n, :n], v)
            pieces.append(torch.matmul(q * attention.query_decay[:, :n], kv_state) + intra)
            kv_state = kv_state * torch.exp(-attention.slope_rate * n) + torch.matmul((k * attention.key_decay[:, -n:]).transpose(-1, -2), v)
        out = torch.cat(pieces, dim=-2)
    cache.update_recurrent_state(kv_state, layer)
    out = attention.norm(out.transpose(1, 2).reshape(b, t, heads * dim))
    out = attention.out_proj(F.sigmoid(attention.output_gate(hidden_states)) * out)
    return out, kv_state


# A family's recurrent block that keeps its state outside transformers' cache interface ->
# kvserve's forward of it over the interface
_OWN_FORWARDS = {"RecurrentGemmaRecurrentBlock": _griffin, "MiniMaxLightningAttention": _lightning}


# transformers' layer types that keep a recurrent state ("hybrid": attention and state in one layer)
RECURRENT_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")


class Slots:
    """The states of up to `num_slots` sequences on `device` (see the module docstring).
    Engine thread only."""

    def __init__(self, spec: Spec, num_slots: int, device: torch.device) -> None:
        self.spec, self.num_slots, self.device = spec, num_slots, torch.device(device)
        self.trash = num_slots
        self.tensors = {name: torch.zeros((num_slots + 1, *shape), dtype=dtype, device=self.device)
                        for name, shape, dtype in spec.shapes}
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot, zeroed lazily (its state counts from the sequence's first token)."""
        if not self._free:
            raise NoSlots(f"all {self.num_slots} recurrent-state slots are taken")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def get(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The named state of the slots `index` [B] (a copy): [B, ...]."""
        return self.tensors[name].index_select(0, index)

    def put(self, name: str, index: torch.Tensor, values: torch.Tensor) -> None:
        self.tensors[name].index_copy_(0, index, values.to(self.tensors[name].dtype))

    def copy(self, source: int, target: int) -> None:
        """Slot `target` takes slot `source`'s state (a checkpoint kept or resumed)."""
        for t in self.tensors.values():
            t[target].copy_(t[source])

    def clear_trash(self) -> None:
        for t in self.tensors.values():
            t[self.trash].zero_()

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's state, named "state.<name>" [1, ...] (for a tier below)."""
        return {f"state.{name}": t[slot : slot + 1].clone() for name, t in self.tensors.items()}

    def load(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put `export`'s tensors back into `slot`; ValueError when they do not fit the spec."""
        for name, _, dtype in self.spec.shapes:
            src = tensors.get(f"state.{name}")
            target = self.tensors[name][slot : slot + 1]
            if src is None or src.dtype != dtype or tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"the state {name} does not fit this model's recurrent layers")
        for name in self.tensors:
            self.tensors[name][slot : slot + 1].copy_(tensors[f"state.{name}"])

    def release(self) -> None:
        self.tensors = {}
