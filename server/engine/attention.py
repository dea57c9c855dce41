"""kvserve's attention over the KV pool, registered with transformers' `AttentionInterface`.

Shapes: a step packs every row's new tokens into one flattened batch of N tokens (input_ids
[1, N], each token's own position in position_ids [1, N]); transformers calls `_attention` per
layer with query [1, H, N, D] and the new keys/values [1, Hkv, N, D]. The step's context
(server/engine/context.py) says whose tokens they are. Two paths, one call each per layer:

* `Batch`es, the paged path (every row on CUDA): B rows of up to T new tokens each. One write
  of their keys/values into the pool at `slots`, one gather of their keys by block table
  (`tables` [B, max_blocks]), one attention call over [B, Hkv, L, D] with each query's position
  as a mask. Decode rows (T = 1) form one batch, first in the flattened batch; multi-token rows
  (prefill chunks, forced and drafted tokens) one batch per power-of-two width, padded (so a
  step makes one or two calls per layer, not one per row). Padding tokens and padding rows
  write the pool's trash block only, so padding never touches a slot a sequence reads. Fixed
  shapes for a given (B, max_blocks): the runner replays a decode batch from a CUDA graph. On
  CPU only when asked for (tests), since it gathers what the row path reads in place. Where
  Triton runs (`Batch.kernel`), every batch skips the gather and the masks: the paged attention
  kernel (server/engine/paged_kernel.py) reads the pool in place through the block tables,
  each query masked to what it sees. A decode batch's store and read are one opaque op,
  `torch.ops.kvserve.decode_attention`, which the compiled decode forward
  (server/engine/compiled.py) calls as it is.
* `Row`s, the row path (every row on CPU): any number of tokens, one attention call per row
  over a view of the row's own keys (a gather when its blocks are not consecutive), with a
  causal mask.

Either way a row's result depends only on its own query, keys and values; only the linear
layers see the batch's shape. Grouped-query attention folds a KV head's query heads into the
query length ([.., Hkv, groups * T, D]): keys are never repeated per query head. Soft-capped
models (Gemma 2) use the eager formula, softmax in float32; everything else is plain
`scaled_dot_product_attention`, CPU or CUDA, fp32 or bf16. In exact mode (`StepContext.exact`,
--deterministic) a query's result depends on nothing else in its step (server/engine/exact.py):
the row path attends a row's queries in spans (`_attend_exact`), the paged path calls
`exact.attend` (on CUDA a Triton kernel, server/engine/exact_kernel.py).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from cache_manager import kv
from server.engine import context, exact, mla, paged_kernel
from server.engine.context import Batch, Row, StepContext, additive
from server.engine.unsupported import UnsupportedModel

ATTN_IMPLEMENTATION = "kvserve"


def enable(model) -> None:
    """Switch `model` to kvserve's attention. Calls outside a kvserve step (transformers' own
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


# Keywords transformers passes the attention function that need nothing from it here (the step
# carries positions and masks); any other keyword with a value is a feature kvserve does not model
# and refuses (`_refuse_unknown`), never drops.
_IGNORED = frozenset({"position_ids", "cache_position", "output_attentions", "use_cache", "is_causal", "return_dict"})


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs):
    """transformers attention function: query [1, H, N, Dk], key [1, Hkv, N, Dk], value [1,
    Hkv, N, Dv] (the step's new tokens) -> ([1, N, H, Dv], None). `s_aux` [H]: attention sinks
    (gpt-oss), one logit per query head that joins every softmax's denominator."""
    step = context.current()
    if step is None:
        if s_aux is not None:
            kwargs["s_aux"] = s_aux
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap, **kwargs)
    layer = module.layer_idx
    if step.observe is not None:
        step.observe(layer, key, value)
    if kwargs or (attention_mask is not None and attention_mask.numel() != 1):
        _refuse_unknown(step, layer, kwargs, attention_mask)
    if not step.pool.layout.latent:
        return _attend_step(step, layer, query, key, value, scaling, softcap, s_aux, step.rows), None
    # MLA from its latent (server/engine/mla.py): decode rows, short chunks and the paged path's
    # batches attend absorbed, one latent KV head; outside exact mode (whose rule is one
    # computation wherever a query is computed) a long prefill chunk on the row path attends the
    # keys decompressed, which costs less (`mla.decompresses`)
    rows, chunks = step.rows, []
    if not step.exact:
        chunks = [row for row in rows if mla.decompresses(module, row.n)]
        rows = [row for row in rows if not mla.decompresses(module, row.n)] if chunks else rows
    out = None
    if step.opaque or rows or step.batches:
        absorbed = _attend_step(step, layer, mla.absorb(module, query, step.exact), key, value, scaling, softcap, s_aux, rows)
        out = mla.expand(module, absorbed, step.exact)
    if chunks:
        out = query.new_empty(1, query.shape[2], query.shape[1], module.v_head_dim) if out is None else out
        for row in chunks:
            _attend_decompressed(module, row, layer, query, key, value, scaling, out)
    return out, None


def _attend_decompressed(module, row: Row, layer: int, query, key, value, scale, out) -> None:
    """An MLA row's queries [1, H, N, nope + rope] (as the module made them) over its keys and
    values decompressed from the latent pool's (`mla.decompress`) -> its part of `out` [1, N, H, v]."""
    lo, hi = row.offset, row.offset + row.n
    k_rot, latent, first = _write_and_read(row, layer, key[:, :, lo:hi], value[:, :, lo:hi])
    keys, values = mla.decompress(module, latent, k_rot)
    mask = _mask(row, layer, first, keys.shape[2], 1, query.dtype)
    out[:, lo:hi] = _attend(query[:, :, lo:hi], keys, values, mask, scale, None).transpose(1, 2)


def _attend_step(step: StepContext, layer: int, query, key, value, scaling, softcap, s_aux, rows: list[Row]) -> torch.Tensor:
    """`_attention`'s body: the step's queries [1, H, N, Dk] over the keys and values of its
    batches and of `rows` (the step's, or some of them), the new ones [1, Hkv, N, Dk / Dv]
    stored first -> [1, N, H, Dv] (the tokens of the step's other rows left unset)."""
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    sinks = None if s_aux is None else s_aux.float().view(kv_heads, groups, 1)  # [Hkv, groups, 1]
    if step.opaque:
        return torch.ops.kvserve.step_attention(query, key, value, layer, scale, softcap, sinks)
    attend = exact.attend if step.exact else _attend
    batches = step.batches
    if not rows and len(batches) == 1 and batches[0].tokens is None and batches[0].size == query.shape[2]:
        # decode rows alone (what a CUDA graph replays): their output is the layer's, no copy
        return _attend_batch(batches[0], layer, query[0], key[0], value[0], groups, scale, softcap, sinks, attend)[None]
    out = _attend_batches(batches, layer, query, key, value, groups, scale, softcap, sinks, attend)
    if step.exact and rows:
        _attend_exact(step, layer, query, key, value, out, groups, scale, softcap, sinks)
        return out
    for row in rows:
        lo, hi = row.offset, row.offset + row.n
        k_row, v_row, first = _write_and_read(row, layer, key[:, :, lo:hi], value[:, :, lo:hi])
        mask = _mask(row, layer, first, k_row.shape[2], groups, query.dtype)
        # [1, H, T, D] -> [1, Hkv, groups * T, D]: a KV head's query heads side by side
        q = query[:, :, lo:hi].reshape(1, kv_heads, groups * row.n, head_dim)
        o = _attend(q, k_row, v_row, mask, scale, softcap, _sink_rows(sinks, row.n))
        out[:, lo:hi] = o.reshape(1, heads, row.n, -1).transpose(1, 2)
    return out


def _attend_batches(batches: list[Batch], layer: int, query, key, value, groups: int, scale, softcap, sinks, attend) -> torch.Tensor:
    """The paged path's batches of a step: query [1, H, N, Dk], key/value [1, Hkv, N, Dk/Dv]
    -> [1, N, H, Dv], their tokens' outputs (the tokens of no batch left unset)."""
    out = query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])
    for batch in batches:
        o = _attend_batch(batch, layer, query[0], key[0], value[0], groups, scale, softcap, sinks, attend)
        if batch.tokens is None:
            out[0, : batch.size] = o
        else:
            out[0].index_copy_(0, batch.targets, o if batch.real is None else o[batch.real])
    return out


@torch.library.custom_op("kvserve::step_attention", mutates_args=())
def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                   softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One layer's attention over the batches of the step running on this thread
    (`_attend_batches`, stores included): query [1, H, N, Dk], key/value [1, Hkv, N, Dk/Dv],
    `sinks` [Hkv, groups, 1] -> [1, N, H, Dv].

    An opaque op that reads its batches from the step's context (`StepContext.opaque`): a
    compiled forward over steps of prefill chunks, forced or drafted tokens beside decode rows
    (server/engine/compiled.py) then holds no batch, so one graph serves every mix of rows and
    widths. The pool's writes are hidden from the compiler, which is sound because within the
    step nothing else in the graph reads or writes the pool (no other op may be reordered
    against them)."""
    groups = query.shape[1] // key.shape[1]
    return _attend_batches(context.current().batches, layer, query, key, value, groups, scale, softcap, sinks, _attend)


@step_attention.register_fake
def _(query, key, value, layer, scale, softcap, sinks):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


def _refuse_unknown(step: StepContext, layer: int, kwargs: dict, attention_mask=None) -> None:
    """Raise UnsupportedModel for what the attention was handed and kvserve does not model: a
    keyword it does not know, a sliding window other than the one the pool's layout has for
    this layer, or a mask other than the model runner's placeholder (the step's rows carry
    the real masks: a model that builds its own, Doge's learned one, would lose it)."""
    if attention_mask is not None and attention_mask.numel() != 1:
        raise UnsupportedModel("attention-mask", f"layer {layer} hands its attention a mask of its own "
                               f"{tuple(attention_mask.shape)}, which kvserve's attention would ignore")
    for name, value in kwargs.items():
        if value is None or name in _IGNORED or name.startswith("output_"):  # what a forward returns, not how it attends
            continue
        if name == "sliding_window":
            window = step.pool.layout.windows[layer]
            if value == window:
                continue
            raise UnsupportedModel("sliding-window", f"layer {layer} attends in a window of {value} where its layer type says {window}")
        raise UnsupportedModel(f"attention-{name}", f"its attention passes `{name}`, which kvserve's attention does not model")


def _sink_rows(sinks: torch.Tensor | None, t: int, rows: int | None = None) -> torch.Tensor | None:
    """Sinks [Hkv, groups, 1] as one logit per folded query row: [1, Hkv, groups * t, 1] (row
    g * t + i is query head g of the KV head), zero-padded to `rows` rows (exact mode's tiles)."""
    if sinks is None:
        return None
    kv_heads, groups = sinks.shape[:2]
    out = sinks.expand(kv_heads, groups, t).reshape(1, kv_heads, groups * t, 1)
    return out if rows is None else F.pad(out, (0, 0, 0, rows - groups * t))


def _attend_batch(batch: Batch, layer: int, query, key, value, groups: int, scale, softcap, sinks, attend) -> torch.Tensor:
    """The paged path for one batch: query [H, N, Dk] (as transformers hands it) and key/value
    [Hkv, N, Dk/Dv] of the whole step -> the batch's outputs [B * T, H, Dv] (padding tokens
    included); `attend`: `_attend` or, in exact mode, `exact.attend`."""
    b, t = batch.size, batch.width
    heads, kv_heads, head_dim, value_dim = query.shape[0], key.shape[0], query.shape[2], value.shape[2]
    if batch.tokens is None:  # decode rows: the step's first B tokens
        q, k_new, v_new = query[:, :b], key[:, :b], value[:, :b]
    else:
        q, k_new, v_new = query[:, batch.tokens], key[:, batch.tokens], value[:, batch.tokens]
    # queries [H, B * T, D] -> [B, Hkv, groups * T, D]
    q = q.reshape(kv_heads, groups, b, t, head_dim).permute(2, 0, 1, 3, 4).reshape(b, kv_heads, groups * t, head_dim)
    window = batch.pool.layout.windows[layer]
    pool = batch.pool
    if batch.tokens is None and attend is _attend:  # decode rows: store and attend in one opaque op
        o = torch.ops.kvserve.decode_attention(
            q, k_new, v_new, pool.keys[layer], pool.values[layer], pool.key_scales[layer], pool.value_scales[layer], batch.slots,
            batch.tables, batch.positions, batch.token_slots, batch.masks.get(window), pool.format.name, pool.block_size,
            scale, softcap, None if sinks is None else sinks.view(kv_heads, groups), window, batch.kernel)
        return o.view(b, heads, value_dim)
    if batch.kernel and attend is _attend:  # multi-token rows: stored, then read in place by the kernel
        stored = pool.keys[layer], pool.values[layer], pool.key_scales[layer], pool.value_scales[layer]
        _store(pool.format, *stored, batch.slots, k_new, v_new, kernel=True)
        o = paged_kernel.paged_attention(q, *stored[:2], batch.tables, batch.positions.view(b, t), pool.block_size, scale, softcap,
                                         None if sinks is None else sinks.view(kv_heads, groups), window,
                                         None if batch.reach is None else batch.reach.view(b, t), *stored[2:], pool.format.name)
    else:
        o = _attend_gathered(batch, layer, q, k_new, v_new, scale, softcap, sinks, attend)
    # [B, Hkv, groups * T, Dv] -> [B * T, H, Dv]
    return o.view(b, kv_heads, groups, t, value_dim).permute(0, 3, 1, 2, 4).reshape(b * t, heads, value_dim)


def _attend_gathered(batch: Batch, layer: int, q, k_new, v_new, scale, softcap, sinks, attend) -> torch.Tensor:
    """A multi-token batch's queries q [B, Hkv, groups * T, Dk] over their rows' keys gathered
    from the pool by block table (the new ones [Hkv, B * T, Dk / Dv] stored first), under the
    batch's masks -> [B, Hkv, groups * T, Dv]."""
    b, t, window = batch.size, batch.width, batch.pool.layout.windows[layer]
    batch.pool.store(layer, batch.slots, k_new, v_new)
    # [Hkv, B, L, D] -> [B, Hkv, L, D]
    k_rows, v_rows = (x.transpose(0, 1) for x in batch.pool.gather(layer, batch.token_slots))
    extra = {} if sinks is None else {"sinks": _sink_rows(sinks, t)}
    if attend is exact.attend:  # where the mask comes from: the kernel skips what a whole tile cannot see
        return attend(q, mla.meet(q, k_rows, v_rows), v_rows, batch.masks[window], scale, softcap, positions=batch.positions.view(b, t),
                      window=window, **extra)
    return attend(q, k_rows, v_rows, batch.masks[window], scale, softcap, **extra)


def _write_and_read(row: Row, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, span: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Store the row's new keys/values at `layer`; return the keys/values its queries attend
    over, in position order, and the position of the first: the whole sequence for a full
    layer, from the first query's first visible key on for a sliding or chunked one
    (`_first_key`).

    `span` (exact mode: `exact.SPAN`): from the first key of the span holding the first query
    (`_first_key`) to the end of the span holding the last; the positions past the row's end
    are masked, and those past its capacity are zeros (a copy: pool blocks are whole spans,
    so only caches of other sizes pay it)."""
    cache = row.kv
    start = cache.length
    end = start + row.n
    window = cache.pool.layout.windows[layer]
    first = _first_key(start - start % span, window, span)
    last = exact.aligned(end, span)
    readable = min(last, kv.capacity(cache))
    if cache.base is None and row.slots is None:
        row.slots = cache.slots(0, readable)  # once per step for every layer
    kv.write(cache, layer, start, k_new, v_new, row.slots)
    keys, values = kv.read(cache, layer, first, readable, row.slots)
    if readable < last:
        keys, values = (F.pad(x, (0, 0, 0, last - readable)) for x in (keys, values))
    return keys, values, first


def _first_key(position: int, window: int | None, span: int = 1) -> int:
    """The first key a query at `position` reads: 0, or with a window the first inside it
    (`context.first_visible`), rounded down to a whole `span`."""
    first = max(0, context.first_visible(position, window))
    return first - first % span


def _mask(row: Row, layer: int, first: int, n_keys: int, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [groups * n, n_keys] of the row's `n` queries (a KV head's query heads
    stacked, as `_attention` folds them) over its keys at positions first..; None where every
    query sees every key (one query). Built once per step for all the layers with the same
    window.

    NOTE: additive (0 / -inf in the query's dtype) because sdpa turns a bool mask into exactly
    that at every call; a step of 4 rows x 4 positions spent ~4 of its 44 ms building and
    converting masks per layer."""
    if row.n == 1:
        return None
    window = row.kv.pool.layout.windows[layer]
    mask = row.masks.get(window)
    if mask is None:
        device = row.kv.pool.device
        reach = None if row.reach is None else torch.tensor(row.reach, device=device)[:, None]
        allowed = _causal(row.kv.length, row.n, torch.arange(first, first + n_keys, device=device), window, reach)
        mask = row.masks[window] = additive(allowed, dtype).repeat(groups, 1)
    return mask


class _Singles:
    """Exact mode's one-token rows (decode steps) of a step on the row path: `index` [R] their
    tokens in the flattened batch, `queries` [R, Hkv, query_rows(groups), D] their queries,
    zero-padded to a whole tile (`views`: one [1, ...] view per row). Each layer gathers the
    queries with one copy and scatters the outputs with one (`_attend_exact`)."""

    def __init__(self, rows: list[Row], query: torch.Tensor, kv_heads: int, groups: int) -> None:
        self.rows = [r for r in rows if r.n == 1]
        self.index = torch.tensor([r.offset for r in self.rows], device=query.device)
        self.queries = query.new_zeros(len(self.rows), kv_heads, exact.query_rows(groups), query.shape[3])
        self.views = [self.queries[i : i + 1] for i in range(len(self.rows))]


def _attend_exact(step: StepContext, layer: int, query, key, value, out, groups: int, scale, softcap, sinks) -> None:
    """Exact mode on the row path (server/engine/exact.py): every row's queries in spans of
    `exact.SPAN` positions aligned to position 0 (`_spans`), one `_attend` call per span over
    the keys from the span's first key (`_first_key`) to its end, the queries zero-padded to
    whole tiles of `exact.Q_TILE` rows. A query's call is then the same computation wherever it
    is made: the same keys, the same read length, the same mask row, a whole number of query
    tiles, whether it is decoded, drafted, forced or prefilled in a chunk of any size. A
    one-token row is one span: their queries are gathered and their outputs scattered with one
    op each for all of them (`_Singles`).

    NOTE: measured on the dev box (torch 2.13's CPU flash SDPA; fp32, bf16 and fp16; 1 and 2
    threads; 1, 2, 3, 5 and 8 query heads per KV head): the read length must be the query's
    own, since the kernel blocks keys by 512 and MKL picks its kernels by a block's length
    (154 of 161 positions rounded differently at some read length between theirs and 2048,
    masked past them); with the query rows in whole tiles of 4, a query rounds alike in calls
    of 4 to 48 rows (0 of 3,498 positions differed, spans of 16 and 64); unpadded, 3 query
    rows round by which thread computes them."""
    heads, kv_heads, head_dim, value_dim = query.shape[1], key.shape[1], query.shape[3], value.shape[3]
    singles = step.memo.get(_Singles)
    if singles is None:
        singles = step.memo[_Singles] = _Singles(step.rows, query, kv_heads, groups)
    if singles.rows:  # [H, R, D] -> [R, Hkv, groups, D]
        count = len(singles.rows)
        singles.queries[:, :, :groups] = query[0, :, singles.index].view(kv_heads, groups, count, head_dim).permute(2, 0, 1, 3)
        outs = []
    for row in step.rows:
        lo, hi = row.offset, row.offset + row.n
        keys, values, first = _write_and_read(row, layer, key[:, :, lo:hi], value[:, :, lo:hi], exact.SPAN)
        spans = _spans(row, layer, first, groups, query)
        if row.n == 1:  # one span over every key read
            sink = _sink_rows(sinks, 1, singles.queries.shape[2])
            outs.append(_attend(singles.views[len(outs)], keys, values, spans[0].mask, scale, softcap, sink))
            continue
        for span in spans:
            a, b, n = lo + span.a, lo + span.b, span.b - span.a
            # [1, H, n, D] -> [1, Hkv, groups * n, D]: into the span's zero-padded query tiles
            span.q_in.copy_(query[:, :, a:b].view(1, kv_heads, groups, n, head_dim))
            sink = _sink_rows(sinks, n, span.q.shape[2])
            o = _attend(span.q, keys[:, :, span.k0 : span.k1], values[:, :, span.k0 : span.k1], span.mask, scale, softcap, sink)
            # [1, Hkv, groups * n, Dv] -> out's [1, n, H, Dv]
            out[:, a:b].view(1, n, kv_heads, groups, value_dim).copy_(o[:, :, : groups * n].view(1, kv_heads, groups, n, value_dim).permute(0, 3, 1, 2, 4))
    if singles.rows:  # [R, Hkv, groups, Dv] -> out's [R, H, Dv]
        out[0].index_copy_(0, singles.index, torch.cat(outs)[:, :, :groups].reshape(count, heads, value_dim))


class _Span(NamedTuple):
    """Queries a..b-1 of a row (exact mode, the row path) and the keys k0..k1-1 of what
    `_write_and_read` read for it: the additive mask [query_rows(groups * n), k1 - k0] (padding
    rows see every key: finite, dropped) and, for a row of more than one token, a zeroed query
    buffer q [1, Hkv, query_rows(groups * n), D] and q_in, its first groups * n rows as
    [1, Hkv, groups, n, D], which each layer overwrites (None for a one-token row: `_Singles`)."""

    a: int
    b: int
    k0: int
    k1: int
    mask: torch.Tensor
    q: torch.Tensor | None
    q_in: torch.Tensor | None


def _spans(row: Row, layer: int, first: int, groups: int, query: torch.Tensor) -> list[_Span]:
    """The row's queries in spans of `exact.SPAN` positions aligned to position 0, keys counted
    from position `first`. Built once per step for all the layers with the same window."""
    window = row.kv.pool.layout.windows[layer]
    spans = row.masks.get(window)
    if spans is None:
        spans, device, start = [], row.kv.pool.device, row.kv.length
        kv_heads, head_dim = row.kv.pool.layout.kv_heads, query.shape[3]
        position = start
        while position < start + row.n:
            base = position - position % exact.SPAN
            stop = min(start + row.n, base + exact.SPAN)
            k0, k1 = _first_key(base, window, exact.SPAN), base + exact.SPAN
            allowed = _causal(position, stop - position, torch.arange(k0, k1, device=device), window).repeat(groups, 1)
            rows = exact.query_rows(allowed.shape[0])
            mask = F.pad(additive(allowed, query.dtype), (0, 0, 0, rows - allowed.shape[0]))
            q = q_in = None
            if row.n > 1:
                q = query.new_zeros(1, kv_heads, rows, head_dim)
                q_in = q[:, :, : allowed.shape[0]].view(1, kv_heads, groups, stop - position, head_dim)
            spans.append(_Span(position - start, stop - start, k0 - first, k1 - first, mask, q, q_in))
            position = stop
        row.masks[window] = spans
    return spans


def _causal(start: int, n: int, key_positions: torch.Tensor, window: int | None, reach: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [n, L]: query at position start+i sees keys at positions <= its own (or its
    `reach` [n, 1]: `context.visible`; and, with a window, > its own - window: transformers'
    sliding-window rule)."""
    return context.visible(key_positions[None, :], torch.arange(start, start + n, device=key_positions.device)[:, None], window, reach)


def _attend(q, keys, values, mask, scale, softcap, sinks=None):
    """q [B, Hkv, M, Dk] over keys/values [B, Hkv, L, Dk/Dv] with an additive `mask` (or None)
    -> [B, Hkv, M, Dv]; `sinks` [1, Hkv, M, 1] (float32): a logit per query row that joins the
    softmax's denominator and adds no value. A latent pool's queries meet its values and keys
    side by side (`mla.meet`)."""
    keys = mla.meet(q, keys, values)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # NOTE: sdpa has neither soft-capping (Gemma 2) nor sinks (gpt-oss): the eager formula,
    # softmax in float32.
    scores = torch.matmul(q, keys.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = torch.cat([scores.float(), sinks.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), values)


def _store(fmt, keys, values, key_scales, value_scales, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel: bool) -> None:
    """New keys [Hkv, N, Dk] and values [Hkv, N, Dv] into one layer's pool storage at `slots`
    [N], quantized to `fmt`: where the kernels run (`kernel`) the K and V stores are one launch
    (`paged_kernel.store_kv`, the same bits); otherwise torch's ops (`kv.put_kv`)."""
    if kernel:
        paged_kernel.store_kv(key, value, keys, values, slots, key_scales, value_scales, fmt.name)
    else:
        kv.put_kv(fmt, keys, values, key_scales, value_scales, slots, key, value)


@torch.library.custom_op("kvserve::decode_attention", mutates_args=("keys", "values", "key_scales", "value_scales"))
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_scales: torch.Tensor | None, value_scales: torch.Tensor | None, slots: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, token_slots: torch.Tensor | None, mask: torch.Tensor | None, kv_format: str,
                     block_size: int, scale: float, softcap: float | None, sinks: torch.Tensor | None, window: int | None,
                     kernel: bool) -> torch.Tensor:
    """Decode rows' attention in one layer, store included: B rows' new key [Hkv, B, Dk] and
    value [Hkv, B, Dv] into the layer's pool storage (`keys`, `values` and, for a quantized
    `kv_format`, their scales) at `slots` [B]; then query [B, Hkv, G, Dk] over each row's keys
    through its block table (`tables` [B, max_blocks], `positions` [B]) -> [B, Hkv, G, Dv].
    `kernel`: the paged attention kernel reads the pool in place (server/engine/paged_kernel.py),
    codes and scales where quantized, and plain storage is written by one store kernel for both
    K and V;
    otherwise the keys at `token_slots` [B, L] are gathered and attended under the additive
    `mask` [B, 1, 1, L] (`Batch.prepare`). `sinks` [Hkv, G].

    An opaque op (torch.library), so that a compiled decode forward (server/engine/compiled.py)
    calls it as it is: no specialising on the layer's pool, no functional copy of the pool for
    the store; eager steps and CUDA graphs call the same op."""
    fmt = kv.kv_format(kv_format)
    _store(fmt, keys, values, key_scales, value_scales, slots, key, value, kernel)
    if kernel:
        return paged_kernel.paged_attention(query, keys, values, tables, positions, block_size, scale, softcap, sinks, window, None,
                                            key_scales, value_scales, kv_format)
    # [Hkv, B, L, D] -> [B, Hkv, L, D]
    k_rows = kv.read_vectors(fmt, keys, key_scales, token_slots, query.dtype).transpose(0, 1)
    v_rows = kv.read_vectors(fmt, values, value_scales, token_slots, query.dtype).transpose(0, 1)
    extra = {} if sinks is None else {"sinks": _sink_rows(sinks.view(*sinks.shape, 1), 1)}
    return _attend(query, k_rows, v_rows, mask, scale, softcap, **extra)


@decode_attention.register_fake
def _(query, key, value, keys, values, key_scales, value_scales, slots, tables, positions, token_slots, mask, kv_format,
      block_size, scale, softcap, sinks, window, kernel):
    return query.new_empty(*query.shape[:-1], values.shape[-1])


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
# NOTE: calls outside a kvserve step (the fallback) still need transformers' own masks (causal,
# sliding window); the eager (additive float) mask suits both eager and sdpa fallbacks.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
