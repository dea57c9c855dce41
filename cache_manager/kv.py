"""Every sequence's KV tensors, and the attention that reads them in a batched forward pass.

This is the only module that touches transformers internals about caches and attention: the
per-layer layout (`get_layer_types_and_kwargs`), the attention-function registry and the
signature of an attention function. A transformers upgrade breaks this file and its tests.

Layout (docs/architecture.md, "KV layout"):

* Each sequence owns a `SequenceKV`: per layer, keys and values [1, kv_heads, size, head_dim].
  A full-attention layer has `size = capacity` (a power-of-two bucket); a sliding-window layer
  has `size = min(window, capacity)` and is a ring: position p lives in slot p % size.
* One engine step packs the new tokens of every row (decode rows: 1 token, or the tokens a
  grammar forced; prefill rows: a chunk) into ONE flattened sequence: input_ids [1, N],
  position_ids [1, N] holding each token's position in its own sequence. Every linear layer,
  the embeddings and the norms run once over the N tokens; there is no padding.
* Attention is our function, registered with transformers' `AttentionInterface` as
  "kvserve". Our calls pass a dummy 4D mask, which transformers passes through untouched
  (it builds no mask); the masks each row needs are built here. For each layer and each row it writes the row's new keys/values into that row's own
  tensors, then attends over a view `[:, :, :length]` of them. So (1) no sequence's KV is
  copied per step (only on growth), (2) attention work per row follows the row's own length,
  not the longest row or its capacity, (3) it is plain `scaled_dot_product_attention` (or the
  eager formula for soft-capped models), on CPU or CUDA, fp32 or bf16.
* A sliding layer attends over its ring as it is while it decodes (the ring holds exactly the
  window). A prefill chunk that wraps the ring reads the window's old keys in order, followed
  by the chunk's own (a copy of at most `window` positions per chunk, not per token), and
  then stores the chunk's last `size` tokens.
* A row's attention output depends only on its own query, keys and values, whatever else is
  in the batch; only the matmuls of the linear layers see the batch's shape.

Grouped-query attention: the query heads of one KV head are folded into the query length
([1, kv_heads, groups * T, head_dim]), so keys are never repeated (copied) per query head.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, eager_mask

MIN_BUCKET = 256
ATTN_IMPLEMENTATION = "kvserve"
_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


def capacity_bucket(n_tokens: int, max_context: int, min_bucket: int = MIN_BUCKET) -> int:
    """Smallest power-of-two capacity >= n_tokens (at least `min_bucket`), capped at the context.

    NOTE: capacities follow need (and grow by doubling) so memory follows the sessions' lengths.
    """
    capacity = min_bucket
    while capacity < n_tokens:
        capacity *= 2
    return min(capacity, max_context)


# -- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """What a model's KV looks like: per layer its window (None: full attention)."""

    windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int

    def sizes(self, capacity: int) -> list[int]:
        return [capacity if w is None else min(w, capacity) for w in self.windows]


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


# -- one sequence's KV -------------------------------------------------------------------------


class SequenceKV:
    """Keys and values of one sequence, per layer [1, kv_heads, size, head_dim]; `length` tokens
    written so far (positions 0..length-1). Only this module reads or writes the tensors."""

    __slots__ = ("keys", "values", "windows", "length", "capacity")

    def __init__(self, lay: Layout, capacity: int, device: torch.device, dtype: torch.dtype, *, zero: bool = True) -> None:
        # NOTE: zero=False for a cache about to be filled (a restore): positions past `length`
        # are never read before they are written, and not writing them twice is faster.
        shapes = [(1, lay.kv_heads, size, lay.head_dim) for size in lay.sizes(capacity)]
        new = torch.zeros if zero else torch.empty
        self.keys = [new(shape, device=device, dtype=dtype) for shape in shapes]
        self.values = [new(shape, device=device, dtype=dtype) for shape in shapes]
        self.windows = lay.windows
        self.length = 0
        self.capacity = capacity


def allocate(config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> SequenceKV:
    """An empty KV for one sequence of up to `capacity` tokens, its tensors allocated now."""
    return SequenceKV(layout(config), capacity, device, dtype)


def length(cache: SequenceKV) -> int:
    """Tokens written so far."""
    return cache.length


def capacity(cache: SequenceKV) -> int:
    """How many positions the sequence may take before it must grow."""
    return cache.capacity


def can_crop(cache: SequenceKV) -> bool:
    """Whether the cache can be cut back to any shorter length.

    Full-attention layers always can. A sliding-window layer can while it has not wrapped
    (length <= its size): past that, the oldest positions were overwritten.
    """
    return all(w is None or cache.length <= k.shape[2] for w, k in zip(cache.windows, cache.keys))


def can_crop_after(cache: SequenceKV, n: int) -> bool:
    """Whether `n` more tokens can be written and then cropped away again, back to the
    current length (speculative decoding's rejected drafts).

    They must fit the capacity, and no sliding-window ring may wrap: a wrapping write
    overwrites positions that are still inside the window after the crop.
    """
    end = cache.length + n
    return end <= cache.capacity and all(w is None or end <= k.shape[2] for w, k in zip(cache.windows, cache.keys))


def crop(cache: SequenceKV, n: int) -> None:
    """Cut the cache back to its first `n` tokens, in place: attention reads only
    `[:length]`, and the next writes overwrite the stale positions."""
    if not 0 <= n <= cache.length:
        raise ValueError(f"cannot crop a cache of {cache.length} tokens to {n}")
    if n < cache.length and not can_crop(cache):
        raise ValueError("a sliding-window layer has wrapped: this cache cannot be cropped")
    cache.length = n


def grow(cache: SequenceKV, config: PretrainedConfig, new_capacity: int) -> SequenceKV:
    """A larger cache holding the same tokens: allocate, copy the KV (bit-identical).

    The old cache is left as it was (the caller drops it). A sliding layer that has wrapped
    is already at its window size, so its ring is copied whole, slots unchanged.
    """
    n = cache.length
    if new_capacity < n:
        raise ValueError(f"new capacity {new_capacity} < {n} cached tokens")
    first = cache.keys[0]
    bigger = allocate(config, new_capacity, first.device, first.dtype)
    for old, new in zip(cache.keys + cache.values, bigger.keys + bigger.values):
        kept = min(n, old.shape[2])
        new[:, :, :kept].copy_(old[:, :, :kept])
    bigger.length = n
    return bigger


def bytes_for(config: PretrainedConfig, capacity: int, dtype: torch.dtype) -> int:
    """Bytes `allocate(config, capacity, ...)` will take, without allocating."""
    lay = layout(config)
    per_position = 2 * lay.kv_heads * lay.head_dim * torch.empty((), dtype=dtype).element_size()
    return sum(lay.sizes(capacity)) * per_position


def nbytes(cache: SequenceKV) -> int:
    """Bytes held by the cache's key and value tensors."""
    return sum(t.numel() * t.element_size() for t in cache.keys + cache.values)


# -- moving a sequence's KV between tiers (device, host memory, disk) --------------------------

LAYOUT_VERSION = 1  # bump when what `export` returns changes meaning: older files then recompute


def export(cache: SequenceKV) -> dict[str, torch.Tensor]:
    """Views of what the cache holds, per layer i: ``k.i``/``v.i`` [1, kv_heads, kept, head_dim]
    with kept = min(length, the layer's size) (a wrapped ring whole, slots as they are).

    NOTE: views, not copies: copy them before the cache is written again.
    """
    tensors = {}
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        kept = min(cache.length, k.shape[2])
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k[:, :, :kept], v[:, :, :kept]
    return tensors


def to_cpu(tensors: dict[str, torch.Tensor], *, copy: bool) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU: copied when `copy` or when they are elsewhere, else as they are."""
    return {name: t.to("cpu", copy=copy) for name, t in tensors.items()}


def load(config: PretrainedConfig, tensors: dict[str, torch.Tensor], length: int, capacity: int, device: torch.device, dtype: torch.dtype) -> SequenceKV:
    """A cache of `capacity` holding `length` tokens whose KV `export` gave (bit-identical).

    Raises ValueError when the tensors do not fit this model's layout, this dtype or `length`
    (a file of another model or version, say): the caller recomputes instead.
    """
    if not 0 < length <= capacity:
        raise ValueError(f"{length} tokens do not fit a cache of {capacity}")
    cache = SequenceKV(layout(config), capacity, device, dtype, zero=False)
    expected = {f"{kind}.{i}" for i in range(len(cache.keys)) for kind in "kv"}
    if set(tensors) != expected:
        raise ValueError("the tensors do not match this model's layers")
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        kept = min(length, k.shape[2])
        for name, dst in ((f"k.{i}", k), (f"v.{i}", v)):
            src = tensors[name]
            if src.dtype != dtype or tuple(src.shape) != (1, dst.shape[1], kept, dst.shape[3]):
                raise ValueError(f"{name}: {tuple(src.shape)} {src.dtype} does not fit {kept} positions of {dtype}")
            dst[:, :, :kept].copy_(src, non_blocking=src.is_pinned())
    cache.length = length
    return cache


# -- a batched forward pass --------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One sequence's part of a step: `n` new tokens at positions kv.length.. (offset: where
    they start in the flattened batch)."""

    kv: SequenceKV
    n: int
    offset: int = 0


def enable(model, packed: bool = True) -> None:
    """Switch `model` to kvserve's attention. Calls without `kvserve_rows` (transformers'
    own `generate`, say) still run the model's original attention. On CPU its linear layers
    run on oneDNN-packed weights (`_pack`), or on the transposed product (`_cpu_linear`) where
    this build cannot pack or `packed` is False (the dense weights only: half the memory of
    the linear layers, slower). Later calls do nothing (`forward` makes the first when none
    was made).

    NOTE: call it on the thread that will run the model (the server's engine thread): packing
    runs multi-threaded, and a second thread that runs multi-threaded torch ops slows every
    step down (docs/architecture.md, "One OpenMP team")."""
    original = model.config._attn_implementation
    if original == ATTN_IMPLEMENTATION:
        return
    layout(model.config)  # refuse unsupported layer kinds up front
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        _ORIGINAL[id(config)] = original
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.device.type == "cpu":
        for module in model.modules():
            if type(module) is torch.nn.Linear and not (packed and _pack(module)):
                module.forward = _cpu_linear.__get__(module)


PACKED_FOR_ROWS = 16  # the row count oneDNN lays a packed weight out for (any count runs on it)


def _pack(layer: torch.nn.Linear) -> bool:
    """On CPU, run `layer` on a copy of its weight packed for oneDNN's matmul (False: this
    build or dtype cannot).

    NOTE: measured on a 2-core AVX-512 box (SmolLM2-135M's linear layers, fp32): PyTorch's
    own `F.linear` (MKL sgemm) runs far below the machine's peak at the few rows of a decode
    step and at the 9-64 of a speculative verification, where a packed weight keeps oneDNN
    near it: 1 row 12 ms (F.linear 25), 16 rows 17 ms (39), 64 rows 40 ms (83), a
    512-token prefill chunk 229 ms (515). The price is memory: the linear weights are held
    twice (the dense ones stay the model's, for its state_dict and transformers' own calls).
    Any other row count gives each row's result up to rounding (docs/architecture.md's
    near-ties).
    """
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACKED_FOR_ROWS)
            probe = torch.zeros(1, layer.in_features, dtype=layer.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, layer.bias, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    layer.kvserve_packed = packed
    layer.forward = _packed_linear.__get__(layer)
    return True


def _packed_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` through its packed weight (`_pack`)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.kvserve_packed, layer.bias, "none", [], "")


ROW_BLOCK = 8  # on CPU, linear layers over 9-32 positions run on a multiple of this many
MAX_TRANSPOSED = 32  # ... and over more positions (prefill chunks) through F.linear


def _cpu_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` ([..., in] -> [..., out]) on CPU where `_pack` cannot, fast for the few
    positions of a decode step (one per sequence, plus drafted tokens).

    NOTE: measured on a 2-core AVX-512 box (SmolLM2-135M, its 211 linear layers): for 1-32 rows,
    MKL's gemv (one row) and its sgemm against a (out x in) weight run far below the
    transposed product weight @ x.T (one decode step: 26 ms instead of 41), and that product
    itself slows down at row counts that are not a multiple of 8 (the linear layers over
    12-15 rows: 57-87 ms, over 16: 46 ms). So one row is computed as two (itself twice), 2-8
    rows as they are, 9-32 rows padded (with copies of the first) to a multiple of ROW_BLOCK:
    a speculative verification of 9-16 positions costs what 16 do (a whole step: 62 ms
    instead of 73-81). Prefill chunks keep `F.linear`, which wins there. Padding never
    changes the real rows' results beyond rounding (the near-ties of docs/architecture.md).
    """
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > MAX_TRANSPOSED:
        return F.linear(x, layer.weight, layer.bias)
    padded = 2 if n == 1 else n if n <= ROW_BLOCK else -(-n // ROW_BLOCK) * ROW_BLOCK
    if padded != n:
        rows = torch.cat([rows, rows[:1].expand(padded - n, -1)])
    out = (layer.weight @ rows.T)[:, :n].T
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


_ORIGINAL: dict[int, str] = {}  # id(config) -> the attention implementation it had


def _fallback(module):
    """The attention the model had before `enable` (its own eager function for "eager")."""
    name = _ORIGINAL.get(id(module.config), "sdpa")
    function = AttentionInterface._global_mapping.get(name)
    return function or sys.modules[type(module).__module__].eager_attention_forward


@torch.inference_mode()
def forward(model, rows: list[Row], token_ids: list[int], logits_rows: list[int], logits_counts: list[int] | None = None) -> torch.Tensor:
    """Run the step's tokens through the model; each row's KV is written into its own cache
    and its `length` moves forward. `token_ids`: the rows' new tokens, concatenated in row
    order. Returns float32 logits at the last token of each listed row (by index into
    `rows`): [len(logits_rows), vocab]; with `logits_counts`, at the last `logits_counts[j]`
    tokens of listed row j, in order: [sum(logits_counts), vocab] (speculative decoding
    verifies every drafted position). Switches the model to kvserve's attention on first use.
    """
    enable(model)
    device = model.device
    positions = []
    offset = 0
    for row in rows:
        row.offset = offset
        positions.extend(range(row.kv.length, row.kv.length + row.n))
        offset += row.n
    if offset != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens for rows of {offset}")
    counts = logits_counts or [1] * len(logits_rows)
    if len(counts) != len(logits_rows) or any(not 1 <= c <= rows[i].n for i, c in zip(logits_rows, counts)):
        raise ValueError(f"logits counts {counts} do not fit rows {logits_rows}")
    ends = [(rows[i].offset + rows[i].n, c) for i, c in zip(logits_rows, counts)]
    keep = torch.tensor([p for end, c in ends for p in range(end - c, end)], dtype=torch.long, device=device)
    out = model(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        attention_mask=_NO_MASK.to(device),  # 4D: transformers' mask building steps aside
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        use_cache=False,
        logits_to_keep=keep,
        kvserve_rows=rows,
        kvserve_masks={},  # each row's masks, built at the first layer that needs them
    )
    for row in rows:
        row.kv.length += row.n
    return out.logits[0].float()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, kvserve_rows=None, kvserve_masks=None, **kwargs):
    """transformers attention function: query [1, H, N, D], key/value [1, Hkv, N, D] (the
    step's new tokens) -> ([1, N, H, D], None). `kvserve_masks`: the step's masks so far."""
    if kvserve_rows is None:
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap, **kwargs)
    layer = module.layer_idx
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = query.new_empty(1, query.shape[2], heads, query.shape[3])
    for i, row in enumerate(kvserve_rows):
        lo, hi = row.offset, row.offset + row.n
        keys, values, first = _write_and_read(row.kv, layer, key[:, :, lo:hi], value[:, :, lo:hi])
        mask = _mask(row.kv, layer, row.n, first, groups, query.dtype, kvserve_masks, i)
        # [1, H, T, D] -> [1, Hkv, groups * T, D]: a KV head's query heads side by side
        q = query[:, :, lo:hi].reshape(1, kv_heads, groups * row.n, query.shape[3])
        o = _attend(q, keys, values, mask, scale, softcap)
        out[:, lo:hi] = o.reshape(1, heads, row.n, -1).transpose(1, 2)
    return out, None


def _write_and_read(kv: SequenceKV, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Store the row's new keys/values in its layer tensors; return what its queries attend
    over (views, except for a wrapping prefill chunk of a sliding layer), in position order,
    and the position of the first of them. A wrapped ring's decode step attends over the
    ring in slot order (first: None): its one query sees the whole window."""
    keys, values, window = kv.keys[layer], kv.values[layer], kv.windows[layer]
    start, n, size = kv.length, k_new.shape[2], keys.shape[2]
    end = start + n
    if end <= size:  # no wrap: positions are slots
        keys[:, :, start:end] = k_new
        values[:, :, start:end] = v_new
        return keys[:, :, :end], values[:, :, :end], 0
    if window is None or size < window:
        raise ValueError(f"{end} tokens exceed the cache's capacity {size}")
    if n == 1:  # a decode step of a wrapped ring: it holds exactly the window
        slot = start % size
        keys[:, :, slot] = k_new[:, :, 0]
        values[:, :, slot] = v_new[:, :, 0]
        return keys, values, None
    # A prefill chunk past the ring: the old window in position order, then the chunk.
    first = max(0, start - window + 1)
    old = torch.arange(first, start, device=keys.device)
    k_all = torch.cat([keys.index_select(2, old % size), k_new], dim=2)
    v_all = torch.cat([values.index_select(2, old % size), v_new], dim=2)
    kept = torch.arange(max(start, end - size), end, device=keys.device)
    keys.index_copy_(2, kept % size, k_new[:, :, kept - start])
    values.index_copy_(2, kept % size, v_new[:, :, kept - start])
    return k_all, v_all, first


def _mask(kv: SequenceKV, layer: int, n: int, first: int | None, groups: int, dtype: torch.dtype, masks: dict, row: int) -> torch.Tensor | None:
    """The additive mask [groups * n, L] of the row's `n` queries (a KV head's query heads
    stacked, as `_attention` folds them) over the keys `_write_and_read` returned at `layer`,
    positions first..; None where every query sees every key (one query). Built once per
    step for all the layers with the same window (`masks`, keyed by row and window).

    NOTE: additive (0 / -inf in the query's dtype) because sdpa turns a bool mask into exactly
    that at every call; a step of 4 rows x 4 positions spent ~4 of its 44 ms building and
    converting masks per layer."""
    if n == 1:
        return None
    window = kv.windows[layer]
    mask = masks.get((row, window))
    if mask is None:
        start = kv.length
        allowed = _causal(start, n, torch.arange(first, start + n, device=kv.keys[layer].device), window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)
        mask = masks[(row, window)] = mask.repeat(groups, 1)
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
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)
AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
# NOTE: calls without kvserve_rows (the fallback) still need transformers' own masks (causal,
# sliding window); the eager (additive float) mask suits both eager and sdpa fallbacks.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
