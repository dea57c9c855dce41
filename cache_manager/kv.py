"""The KV pool: every sequence's keys and values, in storage allocated once, and the handle a
sequence holds on it.

This module and server/engine/attention.py are the only code touching transformers internals about
caches (`get_layer_types_and_kwargs`); a transformers upgrade breaks them and their tests.

Layout (docs/architecture.md, "KV pool"):

* A `Pool` holds, per layer, keys and values [kv_heads, slots, head_dim]: `num_blocks` blocks
  of `block_size` token slots, plus one trash block that belongs to no sequence (padded rows of
  a batch bucket write and read there, so padding never touches a live slot).
* A sequence's `SequenceKV` is its block table into the pool and its `length`: position p lives
  in slot `blocks[p // block_size] * block_size + p % block_size` of every layer. Growing appends
  blocks (no copy), cropping sets the length, `trim` gives the blocks past it back.
* Sliding-window layers keep every position too (the window is applied when attending): any
  cache can be cropped to any length, and one block table serves every layer.
* Blocks are allocated consecutively where possible (cache_manager/blocks.py): a sequence whose
  blocks are consecutive is read as one view of the pool, the others are gathered.
* Bytes are counted in whole blocks: `bytes_for` is what the cache manager's budget counts, and
  the pool is exactly the budget's blocks, so the budget allowing a cache means the pool has its
  blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from cache_manager.blocks import BlockAllocator, NoBlocks

BLOCK_SIZE = 16
_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")

__all__ = ["BLOCK_SIZE", "Layout", "NoBlocks", "Pool", "SequenceKV", "layout"]


# -- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """What a model's KV looks like: per layer its window (None: full attention)."""

    windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Keys and values of one token in every layer."""
        return 2 * len(self.windows) * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def layout(config: PretrainedConfig) -> Layout:
    """The KV layout of `config`; ValueError for layer kinds this engine cannot batch."""
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYERS))
    if unsupported:
        raise ValueError(f"kvserve cannot batch attention layers of type {unsupported}")
    windows = tuple(kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(layer_types, layer_kwargs))
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return Layout(windows, heads, head_dim)



def blocks_for(n_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-n_tokens // block_size)


def bytes_for(config: PretrainedConfig, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of a cache with room for `capacity` tokens (whole blocks)."""
    return blocks_for(capacity) * BLOCK_SIZE * layout(config).bytes_per_token(dtype)


# -- the pool ----------------------------------------------------------------------------------


class Pool:
    """Preallocated KV storage for the sequences of one model (see the module docstring).

    `keys[layer]`, `values[layer]`: [kv_heads, (num_blocks + 1) * block_size, head_dim]; block
    `trash_block` (the last) belongs to no sequence. Engine thread only.
    """

    def __init__(self, config: PretrainedConfig, budget_bytes: int, device: torch.device, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> None:
        self.layout = layout(config)
        self.device, self.dtype, self.block_size = torch.device(device), dtype, block_size
        self.block_bytes = block_size * self.layout.bytes_per_token(dtype)
        num_blocks = budget_bytes // self.block_bytes
        self.allocator = BlockAllocator(num_blocks)
        self.trash_block = num_blocks
        shape = (self.layout.kv_heads, (num_blocks + 1) * block_size, self.layout.head_dim)
        # NOTE: on CPU the storage is left untouched (pages are committed as blocks are used)
        # and a block is zeroed the first time it is handed out: a batched read of a padded row
        # (server/engine/attention.py) multiplies unwritten slots by a zero weight, and garbage NaNs
        # would poison it. On CUDA the pool is memory taken at start-up anyway.
        new = torch.zeros if self.device.type == "cuda" else torch.empty
        try:
            self.keys = [new(shape, device=self.device, dtype=dtype) for _ in self.layout.windows]
            self.values = [new(shape, device=self.device, dtype=dtype) for _ in self.layout.windows]
        except torch.OutOfMemoryError as exc:
            raise MemoryError(
                f"a KV pool of {budget_bytes} bytes does not fit on {self.device} beside the model: "
                "lower --kv-budget-bytes or --kv-budget-fraction"
            ) from exc
        self._zeroed = bytearray([self.device.type == "cuda"]) * (num_blocks + 1)
        self._zero([self.trash_block])

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free_bytes(self) -> int:
        return self.allocator.num_free * self.block_bytes

    def allocate(self, capacity: int) -> "SequenceKV":
        """An empty cache with room for `capacity` tokens; raises NoBlocks."""
        cache = SequenceKV(self)
        grow(cache, capacity)
        return cache

    def take_blocks(self, n: int, after: int | None = None) -> list[int]:
        blocks = self.allocator.allocate(n, after)
        self._zero([b for b in blocks if not self._zeroed[b]])
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of positions start..end-1 of a sequence with these blocks (on the pool's
        device)."""
        bs = self.block_size
        table = torch.tensor(blocks[start // bs : blocks_for(end, bs)], dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()[start % bs : start % bs + end - start]
        return slots.to(self.device, non_blocking=True)

    def store(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values [kv_heads, n, head_dim] into `slots` [n] of `layer`."""
        self.keys[layer].index_copy_(1, slots, keys)
        self.values[layer].index_copy_(1, slots, values)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at the slots of `index` (any shape S) of `layer`: [kv_heads, *S,
        head_dim] copies."""
        return self.keys[layer][:, index], self.values[layer][:, index]

    def _zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        slots = self.slots(blocks, 0, len(blocks) * self.block_size)
        for t in self.keys + self.values:
            t.index_fill_(1, slots, 0)
        for b in blocks:
            self._zeroed[b] = 1


# -- one sequence's KV -------------------------------------------------------------------------


class SequenceKV:
    """One sequence's block table into `pool` and the `length` tokens written so far
    (positions 0..length-1). Only this module and server/engine/attention.py read the storage."""

    __slots__ = ("pool", "blocks", "length", "base")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        self.base: int | None = None  # first slot when the blocks are consecutive, else None

    def _set_blocks(self, blocks: list[int]) -> None:
        self.blocks = blocks
        consecutive = bool(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1))
        self.base = blocks[0] * self.pool.block_size if consecutive else None

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions start..end-1 [end - start] on the pool's device."""
        return self.pool.slots(self.blocks, start, end)


def allocate(config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> SequenceKV:
    """An empty cache for up to `capacity` tokens in a pool of its own (tests, benchmarks and
    one-off forwards; the server allocates from its one pool)."""
    return Pool(config, bytes_for(config, capacity, dtype), device, dtype).allocate(capacity)


def length(cache: SequenceKV) -> int:
    """Tokens written so far."""
    return cache.length


def capacity(cache: SequenceKV) -> int:
    """How many positions the sequence may take before it must grow."""
    return len(cache.blocks) * cache.pool.block_size


def nbytes(cache: SequenceKV) -> int:
    return len(cache.blocks) * cache.pool.block_bytes


def can_crop(cache: SequenceKV) -> bool:
    """Whether the cache can be cut back to any shorter length: always, every layer keeps
    every position (a sliding window is applied when attending)."""
    return True


def can_crop_after(cache: SequenceKV, n: int) -> bool:
    """Whether `n` more tokens can be written and then cropped away again (speculative
    decoding's rejected drafts): they must fit the capacity."""
    return cache.length + n <= capacity(cache)


def crop(cache: SequenceKV, n: int) -> None:
    """Cut the cache back to its first `n` tokens, in place: attention reads only the first
    `length` positions, and the next writes overwrite the stale ones. Keeps the blocks
    (`trim` gives them back)."""
    if not 0 <= n <= cache.length:
        raise ValueError(f"cannot crop a cache of {cache.length} tokens to {n}")
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


def read(cache: SequenceKV, layer: int, start: int, end: int, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..end-1 at `layer`: [1, kv_heads, end - start,
    head_dim], views of the pool when the blocks are consecutive, else gathered copies
    (`slots`: the slot indices of positions 0..end-1 or more, when the caller has them)."""
    pool = cache.pool
    k, v = pool.keys[layer], pool.values[layer]
    if cache.base is not None:
        return k[None, :, cache.base + start : cache.base + end], v[None, :, cache.base + start : cache.base + end]
    slots = cache.slots(start, end) if slots is None else slots[start:end]
    k, v = pool.gather(layer, slots)
    return k[None], v[None]


def write(cache: SequenceKV, layer: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Store keys/values [1, kv_heads, n, head_dim] of positions start.. at `layer`
    (`slots`: the slot indices of positions 0..start+n-1 or more, when the caller has them)."""
    pool, n = cache.pool, k_new.shape[2]
    if start + n > capacity(cache):
        raise ValueError(f"{start + n} tokens exceed the cache's capacity {capacity(cache)}")
    if cache.base is not None:
        pool.keys[layer][:, cache.base + start : cache.base + start + n] = k_new[0]
        pool.values[layer][:, cache.base + start : cache.base + start + n] = v_new[0]
        return
    slots = cache.slots(start, start + n) if slots is None else slots[start : start + n]
    pool.store(layer, slots, k_new[0], v_new[0])


# -- tiers: export and load --------------------------------------------------------------------


# NOTE: bump when what `export` returns changes meaning: older files then recompute.
# 2: sliding-window layers export every position (1: their ring as it was).
LAYOUT_VERSION = 2


def export(cache: SequenceKV) -> dict[str, torch.Tensor]:
    """A copy of the cache's KV as named tensors ("k.<layer>", "v.<layer>": [1, kv_heads,
    length, head_dim]) on its device, for a tier below.

    NOTE: always a copy, never a view of the pool: the cache's blocks go back to the pool
    (and to the next sequence) while a tier is still copying or writing them."""
    tensors = {}
    for i in range(len(cache.pool.keys)):
        k, v = read(cache, i, 0, cache.length)
        tensors[f"k.{i}"], tensors[f"v.{i}"] = (k.clone(), v.clone()) if cache.base is not None else (k, v)
    return tensors


def to_cpu(tensors: dict[str, torch.Tensor], *, copy: bool) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU: copied when `copy` or when they are elsewhere, else as they are."""
    return {name: t.to("cpu", copy=copy) for name, t in tensors.items()}


def load(pool: Pool, tensors: dict[str, torch.Tensor], length: int, capacity: int) -> SequenceKV:
    """A cache of `capacity` in `pool` holding `length` tokens whose KV `export` gave
    (bit-identical).

    Raises ValueError when the tensors do not fit this model's layout, the pool's dtype or
    `length` (a file of another model or version, say): the caller recomputes instead; the
    blocks are given back then. NoBlocks when the pool has no room.
    """
    if not 0 < length <= capacity:
        raise ValueError(f"{length} tokens do not fit a cache of {capacity}")
    expected = {f"{kind}.{i}" for i in range(len(pool.keys)) for kind in "kv"}
    if set(tensors) != expected:
        raise ValueError("the tensors do not match this model's layers")
    lay = pool.layout
    for name, src in tensors.items():
        if src.dtype != pool.dtype or tuple(src.shape) != (1, lay.kv_heads, length, lay.head_dim):
            raise ValueError(f"{name}: {tuple(src.shape)} {src.dtype} does not fit {length} positions of {pool.dtype}")
    cache = pool.allocate(capacity)
    slots = None if cache.base is not None else cache.slots(0, length)  # once for all layers
    for i in range(len(pool.keys)):
        k, v = (tensors[f"{kind}.{i}"].to(pool.device, non_blocking=tensors[f"{kind}.{i}"].is_pinned()) for kind in "kv")
        write(cache, i, 0, k, v, slots)
    cache.length = length
    return cache
