"""The KV pool: every sequence's keys and values, in storage allocated once, and the handle a
sequence holds on it.

This module, cache_manager/state.py and server/engine/attention.py are the only code touching
transformers internals about caches (`get_layer_types_and_kwargs`, the recurrent layers' cache
interface); a transformers upgrade breaks them and their tests.

Layout (docs/architecture.md, "KV pool"):

* A `Pool` holds, per layer, keys [kv_heads, slots, key_dim] and values [kv_heads, slots,
  value_dim] (MLA models, DeepSeek-V3's, have values narrower than keys; served from their
  latent, `Layout.latent`, they keep one "head": the rotary key as the key and the compressed
  KV as the value, server/engine/mla.py): `num_blocks` blocks
  of `block_size` token slots, plus one trash block that belongs to no sequence (padded rows of
  a batch bucket write and read there, so padding never touches a live slot).
* A sequence's `SequenceKV` is its block table into the pool and its `length`: position p lives
  in slot `blocks[p // block_size] * block_size + p % block_size` of every layer. Growing appends
  blocks (no copy), cropping sets the length, `trim` gives the blocks past it back.
* Sliding-window and chunked layers keep every position too (the window is applied when
  attending): any cache can be cropped to any length, and one block table serves every layer.
* Blocks are allocated consecutively where possible (cache_manager/blocks.py): a sequence whose
  blocks are consecutive is read as one view of the pool, the others are gathered.
* Bytes are counted in whole blocks: `bytes_for` is what the cache manager's budget counts, and
  the pool is exactly the budget's blocks, so the budget allowing a cache means the pool has its
  blocks.
* A hybrid model (recurrent layers beside attention: cache_manager/state.py) keeps no KV for its
  recurrent layers (`Layout.no_kv`); the pool holds their per-sequence states in slots taken out
  of the same budget (`Pool.states`, `SequenceKV.state`), and such a cache can only be kept
  whole, emptied, or resumed from a kept state (`checkpoint`, `resume`). A model none of whose
  layers attends (Mamba) keeps states only: they take the whole budget, and its blocks hold no
  bytes (`Pool.block_bytes` 0), bookkeeping of positions only, enough of them for every state
  slot's sequence at `reserve_tokens` (`STATELESS_TOKENS` at least).
* Storage format (`--kv-cache-dtype`, `KV_DTYPES`): `auto` stores keys and values in the model's
  dtype; `fp8` (e4m3) and `int8` store one byte per value plus one bf16 scale per token and KV
  head (its absolute maximum over head_dim maps to the format's largest value), about half the
  bytes of bf16. Values are quantized when stored (`Pool.store`, `write`, `load`) and
  dequantized to the pool's compute dtype (`Pool.dtype`) when read (`Pool.gather`, `read`), so
  attention never sees the storage format. A token's stored bytes depend on its own keys and
  values only: reuse, batching and the tiers store and read the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from cache_manager import state as recurrent
from cache_manager.blocks import BlockAllocator, NoBlocks

BLOCK_SIZE = 16
# The text-config attribute by which server/engine/mla.py (`configure`) says how an MLA model's
# pool keeps its KV: "latent" (`Layout.latent`) or "heads" (transformers' decompressed keys and values)
LATENT = "kvserve_mla_cache"
# Marked on the text config of a model sharded over N tensor-parallel ranks (server/sharding.py):
# each rank's pool keeps its share of the KV heads
SHARDS = "kvserve_tensor_parallel"
_SUPPORTED_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
# Layers that keep a recurrent state (cache_manager/state.py) and no KV ("hybrid": both)
_STATE_ONLY = ("linear_attention", "conv")
_STATE_AND_KV = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# A recurrent state may take this share of the budget; the KV blocks the rest (`Pool`)
STATE_SHARE = 0.5
MAX_STATE_SLOTS = 1024
# A pool whose blocks hold no bytes (a model that keeps states only) has room for a sequence of
# at least this many tokens per state slot (more where `reserve_tokens` asks), in at most this many blocks
STATELESS_TOKENS = 1 << 16
MAX_STATELESS_BLOCKS = 1 << 24
# Kept recurrent states per sequence besides its current one (`checkpoint`): the latest turn's
# start and its prompt's end; each costs a whole state (74 MiB for Qwen3-Next in bf16)
MAX_CHECKPOINTS = 2

__all__ = ["BLOCK_SIZE", "KV_DTYPES", "Layout", "NoBlocks", "Pool", "SequenceKV", "UnsupportedLayers", "kv_format", "layout"]


# -- storage formats ---------------------------------------------------------------------------


SCALE_DTYPE = torch.bfloat16  # one scale per token and KV head: bf16 keeps fp32's range in 2 bytes
_MIN_SCALE = 1e-30  # an all-zero vector gets this scale (and stores zeros), never a division by 0


class _Plain:
    """`auto`: keys and values stored as computed, in the pool's compute dtype."""

    name = "auto"
    quantized = False

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's keys (or values) in one KV head."""
        return head_dim * _itemsize(dtype)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None

    def decode(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return q


class _Scaled:
    """One byte per value (`wire`: float8_e4m3fn or int8) and one bf16 scale per vector (a
    token's keys or values in one KV head): x ~= q * scale, scale = amax(|x|) / qmax. Stored as
    `storage` (uint8 for fp8: indexing kernels exist for it on every device; the `wire` view is
    what tiers and files see)."""

    quantized = True

    def __init__(self, name: str, wire: torch.dtype, storage: torch.dtype, qmax: float, rounds: bool) -> None:
        self.name, self.wire, self.storage, self.qmax, self.rounds = name, wire, storage, qmax, rounds

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.storage

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int:
        return head_dim + _itemsize(SCALE_DTYPE)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., head_dim] -> (q [..., head_dim] in `storage`, scale [...] in SCALE_DTYPE)."""
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / self.qmax).clamp_(min=_MIN_SCALE).to(SCALE_DTYPE)
        q = x / scale.float()
        if self.rounds:
            q = q.round_()
        # NOTE: the bf16 scale may round below amax / qmax: clamp, never overflow to NaN/inf
        q = q.clamp_(-self.qmax, self.qmax).to(self.wire).view(self.storage)
        return q, scale[..., 0]

    def decode(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(q [..., head_dim], scale [...]) -> x [..., head_dim] in `dtype` (a copy)."""
        return q.view(self.wire).to(dtype) * scale.to(dtype)[..., None]


class _Fp8(_Scaled):
    """float8 e4m3 values. On a CPU they are decoded through float16 (`e4m3_as_half`): torch's
    own float8 conversion runs element by element there (measured: 2.7 ms for one SmolLM2
    layer's keys at 4k tokens, against 0.4 ms this way, on the 2-core dev box)."""

    def decode(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if q.device.type != "cpu":
            return super().decode(q, scale, dtype)
        x = e4m3_as_half(q).float().mul_((scale.float() * 256).unsqueeze(-1))
        return x if dtype == torch.float32 else x.to(dtype)


def e4m3_as_half(q: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn bits (uint8) -> float16 of exactly 1/256 of their value, subnormals
    included: the sign, exponent and mantissa bits move into float16's places (exponent bias 15
    instead of 7: a factor 2**-8). Three vectorized integer ops; the NaN codes, which the pool
    never stores (values are clamped), would read as +-480/256."""
    # sign-extended, shifted: bits 14..7 hold the exponent and mantissa, bit 15 the sign, and
    # bit 14 a copy of the sign that the mask 0xBF80 (-16512) clears
    bits = q.view(torch.int8).to(torch.int16)
    return bits.bitwise_left_shift_(7).bitwise_and_(-16512).view(torch.float16)


KV_DTYPES = {
    "auto": _Plain(),
    "fp8": _Fp8("fp8", torch.float8_e4m3fn, torch.uint8, 448.0, rounds=False),
    "int8": _Scaled("int8", torch.int8, torch.int8, 127.0, rounds=True),
}


def kv_format(name: str):
    """The storage format called `name` (`KV_DTYPES`); ValueError names the choices."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}: choose one of {', '.join(KV_DTYPES)}") from None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """What a model's KV looks like: per layer its window, the KV heads, and the widths of a
    head's key and of its value (equal but for MLA models).

    A window says which earlier keys a query sees (`context.visible`, the one rule): None, all
    (full attention); w > 0, the last w positions up to its own (sliding); w < 0, those of its
    own chunk of -w positions up to its own (Llama 4's chunked attention: positions
    c * -w .. (c + 1) * -w - 1 form chunk c). Every layer keeps every position either way."""

    windows: tuple[int | None, ...]
    kv_heads: int
    key_dim: int
    value_dim: int
    # LongRoPE (Phi-3, Phi-4-mini): keys of a sequence longer than this were computed with the
    # long rope factors, of a shorter one with the short factors (server/engine/rope.py); None:
    # a key depends on its position alone
    rope_switch: int | None = None
    # KV shared across layers (Gemma 3n): layer i attends over the keys and values of layer
    # sources[i], which computed the same ones; None: every layer its own
    sources: tuple[int, ...] | None = None
    # Layers that keep no keys and values (a hybrid model's recurrent layers, its MLP-only ones)
    no_kv: tuple[int, ...] = ()
    # Multi-head latent attention kept as its latent (server/engine/mla.py): per token and layer
    # one "KV head" whose key is the shared rotary key (key_dim: qk_rope_head_dim) and whose
    # value is the normalized compressed KV (value_dim: kv_lora_rank), nothing per head
    latent: bool = False
    # query heads per KV head (attention's grouping; one rank's are the same ratio)
    groups: int = 1

    @property
    def owners(self) -> tuple[int, ...]:
        """The layers whose keys and values the pool stores (the others read an owner's, or
        keep none)."""
        if self.sources is None:
            return tuple(i for i in range(len(self.windows)) if i not in self.no_kv)
        return tuple(i for i, source in enumerate(self.sources) if source == i)

    @property
    def attending(self) -> tuple[int, ...]:
        """The layers that attend (once each per forward pass)."""
        return tuple(i for i in range(len(self.windows)) if i not in self.no_kv)

    def rope_long(self, length: int) -> bool:
        """Whether a cache of `length` computed tokens holds long-factor keys: a sequence is
        recomputed when it crosses the switch, and a cache is never kept cropped below it."""
        return self.rope_switch is not None and length > self.rope_switch

    def bytes_per_token(self, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """Keys and values of one token in every layer, stored as `kv_dtype` (`KV_DTYPES`) by
        a model computing in `dtype` (scales included)."""
        fmt = kv_format(kv_dtype)
        per_head = fmt.bytes_per_vector(self.key_dim, dtype) + fmt.bytes_per_vector(self.value_dim, dtype)
        return len(self.owners) * self.kv_heads * per_head

    def widths(self) -> dict[str, int]:
        """"k" and "v": the width of a head's key and value (what `export` names them)."""
        return {"k": self.key_dim, "v": self.value_dim}


class UnsupportedLayers(ValueError):
    """Layer kinds the pool has no layout for (indexed attention, ...)."""

    def __init__(self, kinds: list[str]) -> None:
        super().__init__(f"kvserve has no KV layout for layers of type {kinds}")
        self.kinds = kinds


def layout(config: PretrainedConfig) -> Layout:
    """The KV layout of `config`; UnsupportedLayers for layer kinds this engine cannot batch.

    Key and value widths: `qk_head_dim` and `v_head_dim` where the config has them (MLA:
    DeepSeek-V2/V3, Kimi K2), else `head_dim` (or hidden_size / heads) for both; an MLA model
    whose config server/engine/mla.py marked (`LATENT`) keeps its latent instead (`Layout.latent`).
    A model sharded over tensor-parallel ranks (`SHARDS`) keeps one rank's share of the KV heads.
    server/engine/families.py checks them against what the model's layers really produce."""
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    layer_types, sources = _shared_layers(text_config, layer_types)
    no_kv: tuple[int, ...] = ()
    if any(t in recurrent.RECURRENT_TYPES for t in layer_types) and sources is None:
        # a hybrid: its recurrent layers (and "dummy" MLP-only ones) keep no KV
        no_kv = tuple(i for i, t in enumerate(layer_types) if t in _STATE_ONLY or t == "dummy")
        layer_types = [_STATE_AND_KV.get(t, t) for t in layer_types]
        layer_types = ["full_attention" if i in no_kv else t for i, t in enumerate(layer_types)]
    unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYERS))
    if unsupported:
        raise UnsupportedLayers(unsupported)
    # transformers hands a chunked layer its chunk size as `sliding_window` (its cache keeps a
    # chunk's worth; only the mask differs): the layout marks it chunked by the sign (`Layout`)
    if any(t == "chunked_attention" and not kw.get("sliding_window") for t, kw in zip(layer_types, layer_kwargs)):
        raise UnsupportedLayers(["chunked_attention"])  # chunks of no size
    windows = [kw.get("sliding_window") if t == "sliding_attention" else -kw["sliding_window"] if t == "chunked_attention" else None
               for t, kw in zip(layer_types, layer_kwargs)]
    if sources is not None:  # a sharing layer attends in its source's window
        windows = [windows[source] for source in sources]
    windows = tuple(windows)
    if len(no_kv) == len(windows):  # no layer attends (Mamba: its config has no heads): no KV at all
        return Layout(windows, 0, 0, 0, None, sources, no_kv)
    query_heads, heads, head_dim = attention_heads(text_config)
    if text_config.model_type == "jetmoe":
        # NOTE: JetMoE's attention hands its KV heads on `repeat`ed once per routed query expert
        # (its own cache keeps them once): the pool stores what attention gets, top_k copies
        heads *= text_config.num_experts_per_tok
    key_dim = getattr(text_config, "qk_head_dim", None) or head_dim
    value_dim = getattr(text_config, "v_head_dim", None) or head_dim
    if text_config.model_type == "diffllama":  # both halves of its value heads side by side (server/engine/differential.py)
        value_dim *= 2
    if getattr(text_config, LATENT, None) == "latent":
        return Layout(windows, 1, text_config.qk_rope_head_dim, text_config.kv_lora_rank, rope_switch(text_config), sources, no_kv,
                      latent=True, groups=query_heads)
    shards = getattr(text_config, SHARDS, 1)
    # one rank's KV heads: its share, or the one its query heads read where the heads are fewer
    # than the ranks (server/sharding.py)
    local = max(1, heads // shards)
    groups = query_heads // shards // local
    return Layout(windows, local, key_dim, value_dim, rope_switch(text_config), sources, no_kv, groups=groups)


def attention_heads(text_config: PretrainedConfig) -> tuple[int, int, int]:
    """The text config's attention heads, its KV heads (as many as the heads where it names
    none) and a head's width (`head_dim`, else hidden_size / heads): the one reading of them,
    for the layout and for the tensor-parallel plan (server/sharding.py)."""
    heads = getattr(text_config, "num_attention_heads", 0) or 0
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(text_config, "head_dim", None) or (text_config.hidden_size // heads if heads else 0)


def _shared_layers(text_config: PretrainedConfig, layer_types: list[str]) -> tuple[list[str], tuple[int, ...] | None]:
    """KV shared across layers (`kv_sharing_modes`, Gemma 3n): transformers types a layer that
    reuses another's keys and values "dummy"; its source is the layer of its own type marked
    "store". Returns the layer types with the sharing layers' own restored, and the sources
    (None without sharing)."""
    modes = getattr(text_config, "kv_sharing_modes", None)
    if not modes or "reuse" not in modes:
        return layer_types, None
    own = list(text_config.layer_types)
    stores = {own[i]: i for i, mode in enumerate(modes) if mode == "store"}
    sources, types = [], list(layer_types)
    for i, mode in enumerate(modes):
        if mode == "reuse" and own[i] in stores:
            sources.append(stores[own[i]])
            types[i] = own[i]
        else:
            sources.append(i)
    return types, tuple(sources)


def rope_switch(text_config: PretrainedConfig) -> int | None:
    """The length past which a LongRoPE model switches from its short to its long factors
    (`original_max_position_embeddings`), None for rope that depends on the position alone.
    transformers decides it from the largest position of a forward pass; kvserve per sequence."""
    params = getattr(text_config, "rope_parameters", None) or {}
    per_type = params.values() if params and all(isinstance(p, dict) for p in params.values()) else [params]
    for p in per_type:
        if p.get("rope_type") == "longrope":
            return int(p.get("original_max_position_embeddings") or text_config.original_max_position_embeddings)
    return None



def _state_slots(spec: "recurrent.Spec", budget_bytes: int, spare_bytes: int, share: float = STATE_SHARE) -> int:
    """How many sequences' recurrent states a budget of `budget_bytes` holds: up to
    `share` of it (at most `MAX_STATE_SLOTS`), within the `spare_bytes` one full-context
    sequence's KV leaves, at least one."""
    share = int(budget_bytes * share) // max(spec.nbytes, 1)
    return max(1, min(share, max(spare_bytes, 0) // max(spec.nbytes, 1), MAX_STATE_SLOTS))


def blocks_for(n_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-n_tokens // block_size)


def bytes_for(config: PretrainedConfig, capacity: int, dtype: torch.dtype, kv_dtype: str = "auto", *, sequences: int = 0) -> int:
    """Bytes of a cache with room for `capacity` tokens (whole blocks), stored as `kv_dtype`;
    with `sequences`, a pool's budget for that many such caches' recurrent states beside
    (hybrids: cache_manager/state.py)."""
    spec = recurrent.spec(config, dtype) if sequences else None
    states = sequences * spec.nbytes if spec is not None else 0
    return blocks_for(capacity) * BLOCK_SIZE * layout(config).bytes_per_token(dtype, kv_dtype) + states


# -- the pool ----------------------------------------------------------------------------------


class Pool:
    """Preallocated KV storage for the sequences of one model (see the module docstring).

    `keys[layer]`, `values[layer]`: [kv_heads, (num_blocks + 1) * block_size, key_dim or value_dim] in the
    format's storage dtype; for a quantized format also `key_scales[layer]`,
    `value_scales[layer]`: [kv_heads, slots] (else None). Block `trash_block` (the last) belongs
    to no sequence. `dtype` is the compute dtype: what `gather` and `read` return. Engine thread
    only.
    """

    def __init__(self, config: PretrainedConfig, budget_bytes: int, device: torch.device, dtype: torch.dtype, block_size: int = BLOCK_SIZE,
                 kv_dtype: str = "auto", *, reserve_tokens: int = 0, state_slots: int | None = None) -> None:
        self.layout = layout(config)
        self.format = kv_format(kv_dtype)
        self.device, self.dtype, self.block_size = torch.device(device), dtype, block_size
        self.block_bytes = block_size * self.layout.bytes_per_token(dtype, kv_dtype)
        # A hybrid's recurrent states come out of the same budget (`state_slots`, unless given)
        spec = recurrent.spec(config, dtype)
        self.states: recurrent.Slots | None = None
        if spec is not None:
            slots = state_slots if state_slots is not None else \
                _state_slots(spec, budget_bytes, budget_bytes - reserve_tokens * self.block_bytes // block_size,
                             share=STATE_SHARE if self.block_bytes else 1.0)
            if not self.block_bytes:  # no more sequences than the blocks of no bytes have room for
                slots = max(1, min(slots, MAX_STATELESS_BLOCKS // self._stateless_blocks(reserve_tokens)))
            # the KV blocks' share (the budget less the states'); states only: the states', which
            # the store counts (`nbytes`)
            budget_bytes = budget_bytes - slots * spec.nbytes if self.block_bytes else slots * spec.nbytes
            self.states = recurrent.Slots(spec, slots, self.device)
        self.budget_bytes = budget_bytes
        if self.block_bytes:
            num_blocks = budget_bytes // self.block_bytes
        else:  # states only: blocks of no bytes for every slot's sequence (the module docstring)
            slots = self.states.num_slots if self.states is not None else 1
            num_blocks = min(slots * self._stateless_blocks(reserve_tokens), MAX_STATELESS_BLOCKS)
        self.allocator = BlockAllocator(num_blocks)
        self.trash_block = num_blocks
        slots = (num_blocks + 1) * block_size
        key_shape, value_shape = ((self.layout.kv_heads, slots, width) for width in (self.layout.key_dim, self.layout.value_dim))
        # NOTE: on CPU the storage is left untouched (pages are committed as blocks are used)
        # and a block is zeroed the first time it is handed out: a batched read of a padded row
        # (server/engine/attention.py) multiplies unwritten slots by a zero weight, and garbage NaNs
        # would poison it. On CUDA the pool is memory taken at start-up anyway.
        new = torch.zeros if self.device.type == "cuda" else torch.empty
        storage = self.format.storage_dtype(dtype)
        owners = self.layout.owners
        try:
            keys = {i: new(key_shape, device=self.device, dtype=storage) for i in owners}
            values = {i: new(value_shape, device=self.device, dtype=storage) for i in owners}
            if self.format.quantized:
                key_scales = {i: new(key_shape[:2], device=self.device, dtype=SCALE_DTYPE) for i in owners}
                value_scales = {i: new(key_shape[:2], device=self.device, dtype=SCALE_DTYPE) for i in owners}
            else:
                key_scales = value_scales = dict.fromkeys(owners)
        except torch.OutOfMemoryError as exc:
            raise MemoryError(
                f"a KV pool of {budget_bytes} bytes does not fit on {self.device} beside the model: "
                "lower --kv-budget-bytes or --gpu-memory-utilization, or use --kv-cache-dtype fp8"
            ) from exc
        # per layer, the owner's storage (a layer sharing another's KV writes the same values
        # there again and reads them)
        sources = self.layout.sources or range(len(self.layout.windows))
        self.keys, self.values = [keys.get(s) for s in sources], [values.get(s) for s in sources]
        self.key_scales, self.value_scales = [key_scales.get(s) for s in sources], [value_scales.get(s) for s in sources]
        self._zeroed = bytearray([self.device.type == "cuda"]) * (num_blocks + 1)
        # tensor parallel, on rank 0: the other ranks' pools, which `export` and `load` reach
        # (server/engine/lockstep.py `Leader`); None in one process and on the other ranks
        self.peers = None
        self._zero([self.trash_block])

    def _stateless_blocks(self, reserve_tokens: int) -> int:
        """A states-only pool's blocks (of no bytes) for one sequence (the module docstring)."""
        return blocks_for(max(reserve_tokens, STATELESS_TOKENS), self.block_size)

    def release(self) -> None:
        """Drop the storage (at shutdown, once nothing reads it): the device memory goes back
        even while something still refers to the pool (a logged traceback's frames, say), so a
        model loaded after it in the same process measures its own budget."""
        self.keys, self.values, self.key_scales, self.value_scales = [], [], [], []
        if self.states is not None:
            self.states.release()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots of all the pool's blocks (the trash block aside)."""
        return self.num_blocks * self.block_size

    @property
    def free_bytes(self) -> int:
        return self.allocator.num_free * self.block_bytes

    def allocate(self, capacity: int) -> "SequenceKV":
        """An empty cache with room for `capacity` tokens (and a recurrent-state slot on a
        hybrid); raises NoBlocks (`state.NoSlots` is one)."""
        cache = SequenceKV(self)
        if self.states is not None:
            cache.state = self.states.take()
        try:
            grow(cache, capacity)
        except NoBlocks:
            free(cache)
            raise
        return cache

    def take_blocks(self, n: int, after: int | None = None) -> list[int]:
        blocks = self.allocator.allocate(n, after)
        self.touch(blocks)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Zero those of `blocks` handed out for the first time (the storage docstring in
        `__init__`): as `take_blocks` hands them out, or as a tensor-parallel follower's
        steps name them (server/engine/lockstep.py)."""
        self._zero([b for b in blocks if not self._zeroed[b]])

    def give_back(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of positions start..end-1 of a sequence with these blocks (on the pool's
        device)."""
        bs = self.block_size
        table = torch.tensor(blocks[start // bs : blocks_for(end, bs)], dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()[start % bs : start % bs + end - start]
        return slots.to(self.device, non_blocking=True)

    def store(self, layer: int, slots: torch.Tensor | slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys [kv_heads, n, key_dim] and values [kv_heads, n, value_dim] (compute dtype) into `slots` [n] of `layer`
        (a slice: consecutive slots), quantized to the pool's format."""
        put_kv(self.format, self.keys[layer], self.values[layer], self.key_scales[layer], self.value_scales[layer], slots, keys, values)

    def gather(self, layer: int, index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at the slots of `index` (any shape S) of `layer`: [kv_heads, *S,
        key_dim / value_dim] in the compute dtype; copies (a slice of an `auto` pool: views)."""
        keys = read_vectors(self.format, self.keys[layer], self.key_scales[layer], index, self.dtype)
        values = read_vectors(self.format, self.values[layer], self.value_scales[layer], index, self.dtype)
        return keys, values

    def stored(self, layer: int, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """What the pool holds at `index` [n] of `layer`, as stored (keys, values and their
        scales when quantized): {"k", "v", "k_scale", "v_scale"} -> [kv_heads, n(, width)],
        copies; keys and values in the format's wire dtype."""
        out = {}
        for kind, data, scales in (("k", self.keys, self.key_scales), ("v", self.values, self.value_scales)):
            out[kind] = _copy(data[layer], index).view(self.format.wire_dtype(self.dtype))
            if scales[layer] is not None:
                out[f"{kind}_scale"] = _copy(scales[layer], index)
        return out

    def put_stored(self, layer: int, index: torch.Tensor | slice, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `stored`: the same names, already in the pool's format."""
        storage = self.format.storage_dtype(self.dtype)
        for kind, data, scales in (("k", self.keys, self.key_scales), ("v", self.values, self.value_scales)):
            _put(data[layer], index, tensors[kind].view(storage))
            if scales[layer] is not None:
                _put(scales[layer], index, tensors[f"{kind}_scale"])

    def _zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        slots = self.slots(blocks, 0, len(blocks) * self.block_size)
        for i in self.layout.owners:  # a layer sharing an owner's storage is zeroed with it
            for t in (self.keys[i], self.values[i], self.key_scales[i], self.value_scales[i]):
                if t is not None:
                    t.index_fill_(1, slots, 0)
        for b in blocks:
            self._zeroed[b] = 1


def _copy(source: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """source[:, index] as a tensor of its own (indexing by slots copies already)."""
    picked = source[:, index]
    return picked.clone() if isinstance(index, slice) else picked


def put_kv(fmt, keys: torch.Tensor, values: torch.Tensor, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None,
           index: torch.Tensor | slice, key: torch.Tensor, value: torch.Tensor) -> None:
    """New keys [heads, n, key_dim] and values [heads, n, value_dim] (compute dtype) into one
    layer's storage (`keys`, `values` and their scales) at `index` [n], quantized to `fmt`:
    the one way torch's ops store them (`Pool.store`; the paged attention kernel's one launch
    makes the same bits: `paged_kernel.store_kv`)."""
    put_vectors(fmt, keys, key_scales, index, key)
    put_vectors(fmt, values, value_scales, index, value)


def put_vectors(fmt, data: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor | slice, x: torch.Tensor) -> None:
    """x [heads, n, width] (compute dtype) quantized to `fmt` into one layer's `data` (and
    `scales`) at `index` [n] (half of `put_kv`)."""
    q, scale = fmt.encode(x)
    _put(data, index, q)
    if scale is not None:
        _put(scales, index, scale)


def read_vectors(fmt, data: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
    """One layer's vectors at `index` (any shape S) dequantized from `fmt`: [heads, *S, width]
    in `dtype` (`Pool.gather`'s body)."""
    return fmt.decode(data[:, index], None if scales is None else scales[:, index], dtype)


def _put(target: torch.Tensor, index: torch.Tensor | slice, x: torch.Tensor) -> None:
    """x [heads, n, ...] into `target`'s dimension 1 at `index` (slots, or a slice of them)."""
    if isinstance(index, slice):
        target[:, index] = x
    else:
        target.index_copy_(1, index, x)


# -- one sequence's KV -------------------------------------------------------------------------

_NO_BLOCKS = np.zeros(0, dtype=np.int64)


class SequenceKV:
    """One sequence's block table into `pool` and the `length` tokens written so far
    (positions 0..length-1). Only this module and server/engine/attention.py read the storage."""

    __slots__ = ("pool", "blocks", "table", "length", "base", "state", "checkpoints")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.table = _NO_BLOCKS  # `blocks` as an int64 array: a step's block tables copy it whole (paged_inputs)
        self.length = 0
        self.base: int | None = None  # first slot when the blocks are consecutive, else None
        self.state: int | None = None  # a hybrid's recurrent-state slot: the state after `length` tokens
        self.checkpoints: list[tuple[int, int]] = []  # (length, slot): earlier states kept, by length

    def _set_blocks(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.table = np.array(blocks, dtype=np.int64)
        consecutive = bool(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1))
        self.base = blocks[0] * self.pool.block_size if consecutive else None

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions start..end-1 [end - start] on the pool's device."""
        return self.pool.slots(self.blocks, start, end)


def allocate(config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto") -> SequenceKV:
    """An empty cache for up to `capacity` tokens in a pool of its own (tests, benchmarks and
    one-off forwards; the server allocates from its one pool)."""
    return Pool(config, bytes_for(config, capacity, dtype, kv_dtype, sequences=1), device, dtype, kv_dtype=kv_dtype,
                state_slots=1).allocate(capacity)


def length(cache: SequenceKV) -> int:
    """Tokens written so far."""
    return cache.length


def capacity(cache: SequenceKV) -> int:
    """How many positions the sequence may take before it must grow."""
    return len(cache.blocks) * cache.pool.block_size


def nbytes(cache: SequenceKV) -> int:
    """The device bytes the store counts for `cache`: its blocks' (whole blocks), or where
    blocks hold no bytes (a model that keeps states only) its state's, so that the budget's use
    says how many of its states are held."""
    pool = cache.pool
    if not pool.block_bytes:
        return pool.states.spec.nbytes if pool.states is not None and cache.state is not None else 0
    return len(cache.blocks) * pool.block_bytes


def can_crop(cache: SequenceKV) -> bool:
    """Whether the cache can be cut back to any shorter length: yes when every layer keeps
    every position (a sliding window is applied when attending); no with a recurrent state,
    which is the state after all `length` tokens (it can only be emptied: `crop(cache, 0)`)."""
    return cache.state is None


def can_crop_after(cache: SequenceKV, n: int) -> bool:
    """Whether `n` more tokens can be written and then cropped away again (speculative
    decoding's rejected drafts): they must fit the capacity, and on a LongRoPE model they
    must not cross its switch (keys past it take other factors: the sequence is recomputed
    when it crosses, one token at a time as transformers does)."""
    switch = cache.pool.layout.rope_switch
    if switch is not None and cache.length <= switch < cache.length + n:
        return False
    return cache.length + n <= capacity(cache)


def crop(cache: SequenceKV, n: int) -> None:
    """Cut the cache back to its first `n` tokens, in place: attention reads only the first
    `length` positions, and the next writes overwrite the stale ones. Keeps the blocks
    (`trim` gives them back)."""
    if not 0 <= n <= cache.length:
        raise ValueError(f"cannot crop a cache of {cache.length} tokens to {n}")
    if n not in (0, cache.length) and not can_crop(cache):
        raise ValueError(f"a recurrent state of {cache.length} tokens cannot be cut back to {n}")
    cache.length = n


def grow(cache: SequenceKV, new_capacity: int) -> SequenceKV:
    """Room for `new_capacity` tokens: blocks appended to the table, nothing copied (after
    the last block where it is free). Returns the same cache; raises NoBlocks."""
    pool = cache.pool
    extra = blocks_for(new_capacity, pool.block_size) - len(cache.blocks)
    if extra > 0:
        cache._set_blocks(cache.blocks + pool.take_blocks(extra, cache.blocks[-1] if cache.blocks else None))
    return cache


def trim(cache: SequenceKV) -> None:
    """Give back the blocks past the cache's length (an idle session holds what it uses)."""
    keep = blocks_for(cache.length, cache.pool.block_size)
    if keep < len(cache.blocks):
        cache.pool.give_back(cache.blocks[keep:])
        cache._set_blocks(cache.blocks[:keep])


def free(cache: SequenceKV) -> None:
    """Give back every block; the cache is empty and holds nothing after."""
    if cache.blocks:
        cache.pool.give_back(cache.blocks)
    cache._set_blocks([])
    cache.length = 0
    if cache.state is not None:
        cache.pool.states.give_back(cache.state)
        cache.state = None
    for _, slot in cache.checkpoints:
        cache.pool.states.give_back(slot)
    cache.checkpoints = []


def checkpoint(cache: SequenceKV) -> bool:
    """Keep the recurrent state after the cache's `length` tokens (a hybrid's), so that a
    later `resume` can go back to it: in a free state slot, the oldest of `MAX_CHECKPOINTS`
    given up for it. False (nothing kept) without a state, at length 0, with one kept at this
    length already, or with no slot free (checkpoints never evict anything)."""
    states = cache.pool.states
    if cache.state is None or cache.length == 0 or any(n == cache.length for n, _ in cache.checkpoints):
        return False
    if len(cache.checkpoints) >= MAX_CHECKPOINTS:
        states.give_back(cache.checkpoints.pop(0)[1])
    if states.num_free == 0:
        return False
    slot = states.take()
    states.copy(cache.state, slot)
    cache.checkpoints = sorted(cache.checkpoints + [(cache.length, slot)])
    return True


def resume(cache: SequenceKV, n: int) -> int:
    """Cut the cache back to at most `n` tokens and return its new length: `n` when it can be
    cropped (or is no longer), else (a recurrent state) the latest checkpoint at or before `n`,
    whose state it takes back, or 0 (an empty state) without one. Checkpoints past the new
    length are given up."""
    if n >= cache.length or can_crop(cache):
        crop(cache, min(n, cache.length))
        return cache.length
    states = cache.pool.states
    kept = [(m, slot) for m, slot in cache.checkpoints if m <= n]
    for _, slot in cache.checkpoints[len(kept):]:
        states.give_back(slot)
    cache.checkpoints = kept
    if kept:
        states.copy(kept[-1][1], cache.state)
    cache.length = kept[-1][0] if kept else 0
    return cache.length


def read(cache: SequenceKV, layer: int, start: int, end: int, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..end-1 at `layer` in the compute dtype: [1, kv_heads,
    end - start, key_dim / value_dim]; views of an `auto` pool when the blocks are consecutive, else
    gathered (or dequantized) copies (`slots`: the slot indices of positions 0..end-1 or more,
    when the caller has them)."""
    k, v = cache.pool.gather(layer, _index(cache, start, end, slots))
    return k[None], v[None]


def write(cache: SequenceKV, layer: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Store keys/values [1, kv_heads, n, key_dim / value_dim] of positions start.. at `layer`
    (`slots`: the slot indices of positions 0..start+n-1 or more, when the caller has them)."""
    n = k_new.shape[2]
    if start + n > capacity(cache):
        raise ValueError(f"{start + n} tokens exceed the cache's capacity {capacity(cache)}")
    cache.pool.store(layer, _index(cache, start, start + n, slots), k_new[0], v_new[0])


def _index(cache: SequenceKV, start: int, end: int, slots: torch.Tensor | None) -> torch.Tensor | slice:
    """Where positions start..end-1 live: one slice when the blocks are consecutive, else slots."""
    if cache.base is not None:
        return slice(cache.base + start, cache.base + end)
    return cache.slots(start, end) if slots is None else slots[start:end]


# -- tiers: export and load --------------------------------------------------------------------


# NOTE: bump when what `export` returns changes meaning: older files then recompute.
# 2: sliding-window layers export every position (1: their ring as it was).
LAYOUT_VERSION = 2


def export(cache: SequenceKV) -> dict[str, torch.Tensor]:
    """A copy of the cache's KV as stored, as named tensors on its device, for a tier below:
    "k.<layer>", "v.<layer>" for each layer that owns its KV (`Layout.owners`): [1, kv_heads,
    length, key_dim / value_dim] (the format's wire dtype), and for
    a quantized pool "k_scale.<layer>", "v_scale.<layer>": [1, kv_heads, length].

    NOTE: always a copy, never a view of the pool: the cache's blocks go back to the pool
    (and to the next sequence) while a tier is still copying or writing them."""
    index = _index(cache, 0, cache.length, None)
    tensors = {}
    for i in cache.pool.layout.owners:
        for name, t in cache.pool.stored(i, index).items():
            tensors[f"{name}.{i}"] = t[None]
    if cache.state is not None:  # a hybrid's recurrent state after `length` tokens: "state.<name>"
        tensors.update(cache.pool.states.export(cache.state))
    if cache.pool.peers is not None:  # tensor parallel: every rank's heads, in rank order
        tensors = cache.pool.peers.gather(cache, tensors)
    return tensors


def to_cpu(tensors: dict[str, torch.Tensor], *, copy: bool) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU: copied when `copy` or when they are elsewhere, else as they are."""
    return {name: t.to("cpu", copy=copy) for name, t in tensors.items()}


def load(pool: Pool, tensors: dict[str, torch.Tensor], length: int, capacity: int) -> SequenceKV:
    """A cache of `capacity` in `pool` holding `length` tokens whose KV `export` gave
    (bit-identical).

    Raises ValueError when the tensors do not fit this model's layout, the pool's KV format
    (dtype, scales) or `length` (a file of another model, version or --kv-cache-dtype, say): the
    caller recomputes instead. NoBlocks when the pool has no room.
    """
    if not 0 < length <= capacity:
        raise ValueError(f"{length} tokens do not fit a cache of {capacity}")
    lay, wire = pool.layout, pool.format.wire_dtype(pool.dtype)
    heads = lay.kv_heads * (pool.peers.size if pool.peers is not None else 1)  # every rank's
    kinds = _kinds(pool)
    expected = {f"{kind}.{i}" for i in lay.owners for kind in kinds}
    states = {name: t for name, t in tensors.items() if name.startswith("state.")}
    tensors = {name: t for name, t in tensors.items() if name not in states}
    if set(tensors) != expected or bool(states) != (pool.states is not None):
        raise ValueError(f"the tensors do not match this model's layers in the {pool.format.name} KV format")
    widths = lay.widths()
    for name, src in tensors.items():
        kind = name.split(".")[0]
        dtype, shape = (SCALE_DTYPE, (1, heads, length)) if kind not in widths else (wire, (1, heads, length, widths[kind]))
        if src.dtype != dtype or tuple(src.shape) != shape:
            raise ValueError(f"{name}: {tuple(src.shape)} {src.dtype} does not fit {length} positions of {dtype}")
    cache = pool.allocate(capacity)
    if cache.state is not None:
        try:
            pool.states.load(cache.state, {k: t.to(pool.device) for k, t in states.items()})
        except ValueError:
            free(cache)
            raise
    if pool.peers is not None:  # each rank writes its heads; these are rank 0's
        tensors = pool.peers.scatter(cache, tensors, length)
    put(cache, tensors, length)
    return cache


def put(cache: SequenceKV, tensors: dict[str, torch.Tensor], length: int) -> None:
    """The KV `export` gave (checked by `load`) into the cache's first `length` positions."""
    pool = cache.pool
    kinds = _kinds(pool)
    index = _index(cache, 0, length, None)  # once for all layers
    for i in pool.layout.owners:
        layer = {kind: tensors[f"{kind}.{i}"][0] for kind in kinds}
        pool.put_stored(i, index, {k: t.to(pool.device, non_blocking=t.is_pinned()) for k, t in layer.items()})
    cache.length = length


def _kinds(pool: Pool) -> tuple[str, ...]:
    """What `export` names per layer in `pool`'s format (keys, values, and their scales)."""
    return ("k", "v", "k_scale", "v_scale") if pool.format.quantized else ("k", "v")
