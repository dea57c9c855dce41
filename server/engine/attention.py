"""kvserve's attention over the KV pool, registered with transformers' `AttentionInterface`.

Shapes: a step packs every row's new tokens into one flattened batch of N tokens (input_ids
[1, N], each token's own position in position_ids [1, N]); transformers calls `_attention` per
layer with query [1, H, N, D] and the new keys/values [1, Hkv, N, D]. The step's `Step` (passed
through the model as the `kvserve_step` keyword) says whose tokens they are. Two paths, one
call each per layer:

* `Batch`es, the paged path (every row on CUDA): B rows of up to T new tokens each. One write
  of their keys/values into the pool at `slots`, one gather of their keys by block table
  (`tables` [B, max_blocks]), one attention call over [B, Hkv, L, D] with each query's position
  as a mask. Decode rows (T = 1) form one batch, first in the flattened batch; multi-token rows
  (prefill chunks, forced and drafted tokens) one batch per power-of-two width, padded (so a
  step makes one or two calls per layer, not one per row). Padding tokens and padding rows
  write the pool's trash block only, so padding never touches a slot a sequence reads. Fixed
  shapes for a given (B, max_blocks): the runner replays a decode batch from a CUDA graph. On
  CPU only when asked for (tests), since it gathers what the row path reads in place.
* `Row`s, the row path (every row on CPU): any number of tokens, one attention call per row
  over a view of the row's own keys (a gather when its blocks are not consecutive), with a
  causal mask.

Either way a row's result depends only on its own query, keys and values; only the linear
layers see the batch's shape. Grouped-query attention folds a KV head's query heads into the
query length ([.., Hkv, groups * T, D]): keys are never repeated per query head. Soft-capped
models (Gemma 2) use the eager formula, softmax in float32; everything else is plain
`scaled_dot_product_attention`, CPU or CUDA, fp32 or bf16. In exact mode (`Step.exact`,
--deterministic) both paths read whole key blocks and call `exact.attend` instead, whose
result for a query depends on nothing else in the call (server/engine/exact.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from cache_manager import kv
from server.engine import exact

ATTN_IMPLEMENTATION = "kvserve"


@dataclass(slots=True)
class Row:
    """One sequence's part of a step on the row path: `n` new tokens at positions
    kv.length.. (offset: where they start in the flattened batch)."""

    kv: kv.SequenceKV
    n: int
    offset: int = 0
    slots: torch.Tensor | None = None  # slot of every position 0..length+n-1, when gathered
    masks: dict = field(default_factory=dict)  # window -> the row's additive mask


class Batch:
    """The paged path's per-step tensors for B rows of up to T (`width`) new tokens each, on
    the pool's device: `slots` [B * T] (where each token's key/value goes: the trash block for
    padding tokens), `tables` [B, max_blocks] (block tables, trash block past a row's end),
    `positions` [B * T] (each token's position; a padding token repeats its row's last one).
    `tokens` [B * T]: each token's index in the step's flattened batch (padding tokens: any);
    None for decode rows (T = 1), which come first in the flattened batch. `real` [R]: which of
    the B * T are real tokens (None: all). `prepare` derives the gather index and the masks; in a
    CUDA graph these are persistent buffers, refilled before each replay."""

    def __init__(self, pool: kv.Pool, slots: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                 width: int = 1, tokens: torch.Tensor | None = None, real: torch.Tensor | None = None) -> None:
        self.pool, self.slots, self.tables, self.positions = pool, slots, tables, positions
        self.width, self.tokens, self.real = width, tokens, real
        self.token_slots: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None  # tokens[real]: where the real outputs go
        self.masks: dict[int | None, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return self.tables.shape[0]

    def prepare(self, dtype: torch.dtype, groups: int) -> None:
        """The gather index [B, L] and one additive mask [B, 1, groups * T, L] per window:
        query at position q sees keys at positions <= q (and > q - window). Device ops only:
        this runs inside graph capture."""
        bs = self.pool.block_size
        offsets = torch.arange(bs, device=self.tables.device)
        self.token_slots = (self.tables[:, :, None] * bs + offsets).flatten(1)
        keys = torch.arange(self.token_slots.shape[1], device=self.tables.device)[None, None, :]
        queries = self.positions.view(self.size, self.width, 1)
        self.masks = {}
        for window in set(self.pool.layout.windows):
            allowed = keys <= queries
            if window is not None:
                allowed &= keys > queries - window
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, -math.inf)
            # a KV head's query heads side by side, as `_attend_batch` folds them (one query
            # per row: the same mask for each, broadcast)
            self.masks[window] = (mask.repeat(1, groups, 1) if self.width > 1 else mask)[:, None]
        if self.tokens is not None:
            self.targets = self.tokens if self.real is None else self.tokens[self.real]


@dataclass(slots=True)
class Step:
    """Who the step's flattened tokens belong to: the paged path's batches (decode rows first in
    the flattened batch, one token each) and the row path's rows."""

    rows: list[Row]
    batches: list[Batch] = field(default_factory=list)
    exact: bool = False  # exact mode: `exact.attend` over whole key blocks (server/engine/exact.py)


def enable(model) -> None:
    """Switch `model` to kvserve's attention. Calls without `kvserve_step` (transformers' own
    `generate`, say) still run the model's original attention. Later calls do nothing."""
    original = model.config._attn_implementation
    if original == ATTN_IMPLEMENTATION:
        return
    kv.layout(model.config)  # refuse unsupported layer kinds up front
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        _ORIGINAL[id(config)] = original
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


_ORIGINAL: dict[int, str] = {}  # id(config) -> the attention implementation it had


def _fallback(module):
    """The attention the model had before `enable` (its own eager function for "eager")."""
    name = _ORIGINAL.get(id(module.config), "sdpa")
    function = AttentionInterface._global_mapping.get(name)
    return function or sys.modules[type(module).__module__].eager_attention_forward


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, kvserve_step=None, **kwargs):
    """transformers attention function: query [1, H, N, D], key/value [1, Hkv, N, D] (the
    step's new tokens) -> ([1, N, H, D], None)."""
    if kvserve_step is None:
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap, **kwargs)
    layer = module.layer_idx
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    out = query.new_empty(1, query.shape[2], heads, head_dim)
    attend = exact.attend if kvserve_step.exact else _attend
    for batch in kvserve_step.batches:
        _attend_batch(batch, layer, query[0], key[0], value[0], out[0], groups, scale, softcap, attend)
    for row in kvserve_step.rows:
        lo, hi = row.offset, row.offset + row.n
        k_row, v_row, first = _write_and_read(row, layer, key[:, :, lo:hi], value[:, :, lo:hi], kvserve_step.exact)
        mask = _mask(row, layer, first, k_row.shape[2], groups, query.dtype, kvserve_step.exact)
        # [1, H, T, D] -> [1, Hkv, groups * T, D]: a KV head's query heads side by side
        q = query[:, :, lo:hi].reshape(1, kv_heads, groups * row.n, head_dim)
        o = attend(q, k_row, v_row, mask, scale, softcap)
        out[:, lo:hi] = o.reshape(1, heads, row.n, -1).transpose(1, 2)
    return out, None


def _attend_batch(batch: Batch, layer: int, query, key, value, out, groups: int, scale, softcap, attend) -> None:
    """The paged path for one batch: query/out [N, H, D] and key/value [Hkv, N, D] of the
    whole step (query [H, N, D] as transformers hands it); `attend`: `_attend` or, in exact
    mode, `exact.attend` (the runner then reads whole key blocks: `ModelRunner._batch`)."""
    b, t = batch.size, batch.width
    heads, kv_heads, head_dim = query.shape[0], key.shape[0], query.shape[2]
    if batch.tokens is None:  # decode rows: the step's first B tokens
        q, k_new, v_new = query[:, :b], key[:, :b], value[:, :b]
    else:
        q, k_new, v_new = query[:, batch.tokens], key[:, batch.tokens], value[:, batch.tokens]
    batch.pool.store(layer, batch.slots, k_new, v_new)
    # [Hkv, B, L, D] -> [B, Hkv, L, D]; queries [H, B * T, D] -> [B, Hkv, groups * T, D]
    k_rows, v_rows = (x.transpose(0, 1) for x in batch.pool.gather(layer, batch.token_slots))
    q = q.reshape(kv_heads, groups, b, t, head_dim).permute(2, 0, 1, 3, 4).reshape(b, kv_heads, groups * t, head_dim)
    o = attend(q, k_rows, v_rows, batch.masks[batch.pool.layout.windows[layer]], scale, softcap)
    # [B, Hkv, groups * T, D] -> [B * T, H, D]
    o = o.view(b, kv_heads, groups, t, head_dim).permute(0, 3, 1, 2, 4).reshape(b * t, heads, head_dim)
    if batch.tokens is None:
        out[:b] = o
    else:
        out.index_copy_(0, batch.targets, o if batch.real is None else o[batch.real])


def _write_and_read(row: Row, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, whole_blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Store the row's new keys/values at `layer`; return the keys/values its queries attend
    over, in position order, and the position of the first: the whole sequence for a full
    layer, the last `window` positions before the first query onwards for a sliding one.

    `whole_blocks` (exact mode): from the start of the key block holding the first to the end
    of the block holding the last (`exact.KV_BLOCK`); the positions past the row's end are
    masked, and those past its capacity are zeros (a copy: the engine reserves whole blocks,
    so only callers that do not pay it)."""
    cache = row.kv
    start = cache.length
    end = start + row.n
    window = cache.pool.layout.windows[layer]
    first = 0 if window is None else max(0, start - window + 1)
    last = end
    if whole_blocks:
        first -= first % exact.KV_BLOCK
        last = exact.aligned(end)
    readable = min(last, kv.capacity(cache))
    if cache.base is None and row.slots is None:
        row.slots = cache.slots(0, readable)  # once per step for every layer
    kv.write(cache, layer, start, k_new, v_new, row.slots)
    keys, values = kv.read(cache, layer, first, readable, row.slots)
    if readable < last:
        keys, values = (F.pad(x, (0, 0, 0, last - readable)) for x in (keys, values))
    return keys, values, first


def _mask(row: Row, layer: int, first: int, n_keys: int, groups: int, dtype: torch.dtype, whole_blocks: bool = False) -> torch.Tensor | None:
    """The additive mask [groups * n, n_keys] of the row's `n` queries (a KV head's query heads
    stacked, as `_attention` folds them) over its keys at positions first..; None where every
    query sees every key (one query, unless `whole_blocks` read keys past it). Built once per
    step for all the layers with the same window.

    NOTE: additive (0 / -inf in the query's dtype) because sdpa turns a bool mask into exactly
    that at every call; a step of 4 rows x 4 positions spent ~4 of its 44 ms building and
    converting masks per layer."""
    if row.n == 1 and not whole_blocks:
        return None
    window = row.kv.pool.layout.windows[layer]
    mask = row.masks.get(window)
    if mask is None:
        start = row.kv.length
        device = row.kv.pool.device
        allowed = _causal(start, row.n, torch.arange(first, first + n_keys, device=device), window)
        if whole_blocks:  # exact.attend computes in float32
            dtype = torch.float32
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf).repeat(groups, 1)
        if whole_blocks:  # the query rows exact.attend pads to see every key (finite, unused)
            mask = F.pad(mask, (0, 0, 0, exact.query_rows(mask.shape[0]) - mask.shape[0]))
        row.masks[window] = mask
    return mask


def _causal(start: int, n: int, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [n, L]: query at position start+i sees keys at positions <= its own (and, with a
    window, > its own - window: transformers' sliding-window rule)."""
    q = torch.arange(start, start + n, device=key_positions.device)[:, None]
    mask = key_positions[None, :] <= q
    if window is not None:
        mask &= key_positions[None, :] > q - window
    return mask


def _attend(q, keys, values, mask, scale, softcap):
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # NOTE: sdpa has no soft-capping (Gemma 2): the eager formula, softmax in float32.
    scores = torch.matmul(q, keys.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
# NOTE: calls without kvserve_step (the fallback) still need transformers' own masks (causal,
# sliding window); the eager (additive float) mask suits both eager and sdpa fallbacks.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
