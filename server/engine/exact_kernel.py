"""Exact mode's Triton kernels: the paged attention (server/engine/exact.py `attend`'s
contract) and a linear layer (`linear`, where cuBLAS's fixed tiles are unfit: exact.enable):
each query's, each row's result is the same bits whatever else the launch computes.

Why a kernel: cuBLAS picks a matmul kernel by shape (rows, columns, reduction length, batch
count). A decode step's few-row score matmul and a prefill chunk's thousands of rows can take
different kernels, one of which splits the reduction across warps ("sliced-K"), so a position
decoded would round differently from the same position prefilled. Here every launch runs one
compiled program, whose tile shapes are compile-time constants fixed by the head size alone.

A program is one KV head of one row and BLOCK_M query rows (a KV head's query heads side by
side, as the paged path folds them). A query's keys are reduced in chunks of CHUNK positions
aligned to position 0; inside a chunk, blocks of BLOCK_N keys in order from a fresh start
with FlashAttention's online softmax (a running max and sum per query, `_chunk`); the
chunks' states are then merged in position order (`_merge`). That is the arithmetic of every
query in every launch; only who does it varies: one program walks its chunks in turn, or
(few programs: a decode step of few rows over long contexts) each chunk is its own program
and a second launch merges them (`_combine`), as flash-decoding does, with a fixed split.
Attention sinks (gpt-oss's: a logit per query head in the softmax's denominator, with no
value) weigh in once, after the last chunk's merge, in whichever kernel writes the output
(`_sink`). A query's result then depends only on its own query vector, its keys and values,
its mask row and its sink:

* its scores and its share of P @ V are rows of tile matmuls, and a matmul's rows never mix;
* a block or a chunk the query cannot see (past it, before its window, past the row's end)
  changes nothing: its weights are exactly 0 and the running state is rescaled by exp(0) =
  1; given the queries' positions, the blocks that no query of the tile can see are not
  computed at all (the same no-op), by the loop's bounds rather than a branch, so the
  compiler pipelines the loop's loads;
* the number of rows, queries, keys and programs are runtime arguments, never specialized on
  (`do_not_specialize`): they decide how many programs run, not what one computes;
* no fused multiply-adds (`enable_fp_fusion=False`): `_merge` runs in two kernels, and a
  compiler fuses by context.

Keys sit at their absolute positions (the paged gather starts at position 0), so a query's
blocks and the mask inside each are the same in every launch. Arithmetic is float32 (the
matmuls accumulate in it; in bf16/fp16 the weights are rounded to the values' dtype before
P @ V, as FlashAttention does); float32 models use IEEE float32 matmuls, not TF32.

Triton compiles the kernels on their first launch (seconds; `exact.use_kernel` does it at
start-up, and checks both ways of walking the chunks give the same bits). Off a GPU, Triton's
interpreter (TRITON_INTERPRET=1) runs the same kernels with NumPy: tests/server/test_exact.py
checks them on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # query rows per program (tl.dot's smallest tile)
BLOCK_N = 64  # keys per step of a program's walk
CHUNK = 512  # keys per chunk: a query's keys are reduced chunk by chunk, chunks merged in order
PARALLEL_BELOW = 512  # launches of fewer (row, KV head, query tile) programs spread chunks over programs
spread = True  # whether `attend` may spread chunks (exact.use_kernel turns it off if the two ways disagree)


@triton.jit
def _chunk(q, k_base, v_base, m_base, live, dims, begin, end, hi, k_n, v_n, scale, softcap,
           DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_P2: tl.constexpr,
           SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One chunk's keys (those before `hi`, its end) from a fresh start: (running max, sum of
    weights, weighted values) per query row, FlashAttention's online softmax, blocks of
    BLOCK_N in order; the blocks from `begin` (a block's start) to `end` (the tile's bounds
    within the chunk: the blocks outside would be exact no-ops)."""
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < hi
        # padding rows and keys past the chunk see nothing: -inf
        bias = tl.load(m_base + cols[None, :], mask=live[:, None] & inside[None, :], other=float("-inf")).to(tl.float32)
        kt = tl.load(k_base + cols[None, :] * k_n + dims[:, None], mask=inside[None, :] & (dims[:, None] < DIM), other=0.0)
        if IEEE:
            scores = tl.dot(q, kt, input_precision="ieee")
        else:
            scores = tl.dot(q, kt)
        scores = scores * scale
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh through exp(-2|x|)
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            t = (1.0 - e) / (1.0 + e)
            scores = softcap * tl.where(scores < 0, -t, t)
        scores = scores + bias
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # nothing seen yet: weights 0, not NaN
        rescale = tl.exp(top - shift)
        weights = tl.exp(scores - shift[:, None])
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + cols[:, None] * v_n + dims[None, :], mask=inside[:, None] & (dims[None, :] < DIM), other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        top = new_top
    return top, total, acc


@triton.jit
def _merge(top, total, acc, c_top, c_total, c_acc):
    """The running state with one more chunk's (in position order): a chunk no query of the
    row saw (max -inf, sums 0) leaves it as it was, bit for bit."""
    new_top = tl.maximum(top, c_top)
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    mine = tl.exp(top - shift)
    theirs = tl.exp(c_top - shift)
    return new_top, total * mine + c_total * theirs, acc * mine[:, None] + c_acc * theirs[:, None]


@triton.jit
def _sink(top, total, acc, sink):
    """The merged state with each row's sink logit joining the denominator (weight exp(sink),
    no value): the max taken with the sink, so no weight overflows. A sink of -inf leaves the
    state as it was, bit for bit."""
    new_top = tl.maximum(top, sink)
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    mine = tl.exp(top - shift)
    return total * mine + tl.exp(sink - shift), acc * mine[:, None]


@triton.jit(do_not_specialize=["queries", "keys", "heads", "chunks", "width", "window", "p_b",
                               "q_b", "q_h", "q_m", "k_b", "k_h", "k_n", "v_b", "v_h", "v_n", "m_b", "m_h", "m_m", "o_b", "o_h", "o_m"])
def _attend(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, pos_ptr, sink_ptr, queries, keys, heads, chunks, width, window, p_b, scale, softcap,
            q_b, q_h, q_m, k_b, k_h, k_n, v_b, v_h, v_n, m_b, m_h, m_m, o_b, o_h, o_m,
            DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
            PARALLEL: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr, BOUNDED: tl.constexpr,
            SINKS: tl.constexpr):
    """PARALLEL: program (row x KV head, query tile, chunk) writes its chunk's state to the
    `part_ptr` buffer for `_combine`; otherwise program (row x KV head, query tile) walks the
    chunks in order, merging each, and writes the output. ALIGNED: the strides come in units
    of 16 elements (`attend`), so the compiler knows them multiples of 16 and vectorizes the
    loads (tl.multiple_of on a scalar argument does not reach its analysis). BOUNDED: query
    row r of row b is at position pos[b, r % width] (window > 0: the keys it sees are those
    after position - window; < 0: those of its chunk, `kv.Layout`; none = 0), so a tile's queries see keys first..last-1 at most
    and the blocks outside, which the mask hides from all of them, are not computed (exact
    no-ops either way, whose skipping keeps the loop free of branches for the compiler's
    software pipelining). SINKS: `sink_ptr` holds a float32 logit per (row x KV head, query
    row), [B * Hkv, queries] (`_sink`)."""
    # NOTE: the strides in int64 before any product: Triton passes an argument under 2**31 as an
    # int32, and int32 products of a stride (times 16, a query row, a key column) wrap past
    # 2**31 elements, as a long prompt's mask [B, 1, G * T, L] reaches on a large card
    q_b, q_h, q_m, k_b, k_h, k_n = q_b.to(tl.int64), q_h.to(tl.int64), q_m.to(tl.int64), k_b.to(tl.int64), k_h.to(tl.int64), k_n.to(tl.int64)
    v_b, v_h, v_n, m_b, m_h, m_m = v_b.to(tl.int64), v_h.to(tl.int64), v_n.to(tl.int64), m_b.to(tl.int64), m_h.to(tl.int64), m_m.to(tl.int64)
    o_b, o_h, o_m = o_b.to(tl.int64), o_h.to(tl.int64), o_m.to(tl.int64)
    if ALIGNED:
        q_b, q_h, q_m, k_b, k_h, k_n, v_b, v_h, v_n = q_b * 16, q_h * 16, q_m * 16, k_b * 16, k_h * 16, k_n * 16, v_b * 16, v_h * 16, v_n * 16
        m_b, m_h, m_m, o_b, o_h, o_m = m_b * 16, m_h * 16, m_m * 16, o_b * 16, o_h * 16, o_m * 16
    row = tl.program_id(0).to(tl.int64)
    b, h = row // heads, row % heads
    tile = tl.program_id(1)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_P2)
    live = rows < queries
    q = tl.load(q_ptr + b * q_b + h * q_h + rows[:, None] * q_m + dims[None, :], mask=live[:, None] & (dims[None, :] < DIM), other=0.0)
    k_base, v_base = k_ptr + b * k_b + h * k_h, v_ptr + b * v_b + h * v_h
    m_base = mask_ptr + b * m_b + h * m_h + rows[:, None] * m_m
    first = 0
    last = keys
    if BOUNDED:
        pos = tl.load(pos_ptr + b * p_b + rows % width, mask=live, other=0).to(tl.int32)
        last = tl.minimum(tl.max(tl.where(live, pos, -1), 0) + 1, keys)
        low = tl.min(tl.where(live, pos, keys), 0)  # the tile's first query
        chunk = tl.maximum(-window, 1)
        first = tl.where(window > 0, tl.maximum(low - window + 1, 0), tl.where(window < 0, low - low % chunk, 0))
    first = first // BLOCK_N * BLOCK_N  # blocks start where they always do
    if PARALLEL:
        c = tl.program_id(2)
        lo = c * CHUNK
        top, total, acc = _chunk(q, k_base, v_base, m_base, live, dims, tl.maximum(lo, first), tl.minimum(lo + CHUNK, last),
                                 tl.minimum(lo + CHUNK, keys), k_n, v_n, scale, softcap, DIM, BLOCK_M, BLOCK_N, DIM_P2, SOFTCAP, IEEE)
        _store_part(part_ptr, (row * chunks + c) * tl.num_programs(1) + tile, top, total, acc, BLOCK_M, DIM_P2)
    else:
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
        for lo in range(first // CHUNK * CHUNK, last, CHUNK):
            c_top, c_total, c_acc = _chunk(q, k_base, v_base, m_base, live, dims, tl.maximum(lo, first), tl.minimum(lo + CHUNK, last),
                                           tl.minimum(lo + CHUNK, keys), k_n, v_n, scale, softcap, DIM, BLOCK_M, BLOCK_N, DIM_P2, SOFTCAP, IEEE)
            top, total, acc = _merge(top, total, acc, c_top, c_total, c_acc)
        if SINKS:
            total, acc = _sink(top, total, acc, tl.load(sink_ptr + row * queries + rows, mask=live, other=0.0))
        _store_out(out_ptr + b * o_b + h * o_h, rows, dims, live, total, acc, o_m, DIM)


@triton.jit(do_not_specialize=["queries", "heads", "chunks", "o_b", "o_h", "o_m"])
def _combine(part_ptr, out_ptr, sink_ptr, queries, heads, chunks, o_b, o_h, o_m,
             DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_M: tl.constexpr, SINKS: tl.constexpr):
    """Program (row x KV head, query tile): the chunks' states merged in position order (then
    the sinks, SINKS: `_attend`'s)."""
    row = tl.program_id(0).to(tl.int64)
    b, h = row // heads, row % heads
    tile = tl.program_id(1)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_P2)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    for c in range(0, chunks):
        c_top, c_total, c_acc = _load_part(part_ptr, (row * chunks + c) * tl.num_programs(1) + tile, BLOCK_M, DIM_P2)
        top, total, acc = _merge(top, total, acc, c_top, c_total, c_acc)
    live = rows < queries
    if SINKS:
        total, acc = _sink(top, total, acc, tl.load(sink_ptr + row * queries + rows, mask=live, other=0.0))
    _store_out(out_ptr + b * o_b + h * o_h, rows, dims, live, total, acc, o_m, DIM)


@triton.jit
def _store_part(part_ptr, slot, top, total, acc, BLOCK_M: tl.constexpr, DIM_P2: tl.constexpr):
    """One program's chunk state at `slot` of the buffer [slots, BLOCK_M, DIM_P2 + 2] (float32:
    a row's weighted values, then its max and its sum)."""
    base = part_ptr + slot * (BLOCK_M * (DIM_P2 + 2)) + tl.arange(0, BLOCK_M) * (DIM_P2 + 2)
    tl.store(base[:, None] + tl.arange(0, DIM_P2)[None, :], acc)
    tl.store(base + DIM_P2, top)
    tl.store(base + DIM_P2 + 1, total)


@triton.jit
def _load_part(part_ptr, slot, BLOCK_M: tl.constexpr, DIM_P2: tl.constexpr):
    base = part_ptr + slot * (BLOCK_M * (DIM_P2 + 2)) + tl.arange(0, BLOCK_M) * (DIM_P2 + 2)
    return tl.load(base + DIM_P2), tl.load(base + DIM_P2 + 1), tl.load(base[:, None] + tl.arange(0, DIM_P2)[None, :])


@triton.jit
def _store_out(out_base, rows, dims, live, total, acc, o_m, DIM: tl.constexpr):
    out = acc / tl.where(live, total, 1.0)[:, None]  # padding rows saw nothing: 0, not 0 / 0
    tl.store(out_base + rows[:, None] * o_m + dims[None, :], out.to(out_base.dtype.element_ty), mask=live[:, None] & (dims[None, :] < DIM))


def _fits(x: torch.Tensor, strides: bool) -> bool:
    """Whether x's data is 16-byte aligned, its last dimension dense and (`strides`) every
    other stride a multiple of 16 (`_strides`')."""
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and not (strides and any(st % 16 for st in _strides(x)))


def _aligned(x: torch.Tensor, strides: bool) -> torch.Tensor:
    """x, or a contiguous copy where it does not `_fits`."""
    return x if _fits(x, strides) else x.clone(memory_format=torch.contiguous_format)


def _strides(x: torch.Tensor) -> list[int]:
    """The strides of x's dimensions but the last, 0 for a dimension of size 1 (its only
    index is 0, whatever the stride)."""
    return [st if size > 1 else 0 for st, size in zip(x.stride()[:-1], x.shape[:-1])]


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy, contiguous and 16-byte aligned."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None,
           parallel: bool | None = None, positions: torch.Tensor | None = None, window: int | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`exact.attend` as one or two kernel launches: q [B, Hkv, M, D], keys/values [B, Hkv, L,
    D] (any L; key i at position i), `mask` additive (0 / -inf) broadcastable to [B, Hkv, M,
    L] (or [.., query_rows(M), L]), every query seeing at least one key. Returns [B, Hkv, M,
    D] in q's dtype. `parallel`: spread the chunks of a row over programs (a buffer and a
    second launch) or walk them in one (default: parallel when the launch has fewer than
    PARALLEL_BELOW programs otherwise and more than one chunk); the bits are the same.
    `positions` [B, T] (optional): query row r of row b is at positions[b, r % T], and the mask
    is causal from there (and hides keys before `window`'s first, `context.first_visible`): the launch then
    skips the blocks a tile's queries cannot see; the bits are the same. `sinks`: a logit per
    query row broadcastable to [B, Hkv, M, 1] (or [.., query_rows(M), 1]), `exact.attend`'s;
    the kernels read them as float32 [B * Hkv, M] (a small copy).

    Values of another width than the keys (MLA: DeepSeek-V3's keys 192 wide, values 128) are
    zero-padded to the wider one, the queries and keys too where the values are wider, and
    the output cut back: a zero column adds nothing, and the padding depends on the model's
    shapes alone, so a query's bits still depend on nothing else in the launch."""
    d, dv = q.shape[-1], values.shape[-1]
    if dv != d:
        width = max(d, dv)
        q, keys, values = (F.pad(x, (0, width - x.shape[-1])) for x in (q, keys, values))
        return attend(q, keys, values, mask, scale, softcap, parallel, positions, window, sinks)[..., :dv]
    b, h, m, d = q.shape
    n = keys.shape[2]
    if mask.shape[-2] not in (1, m):  # exact.attend's padded form: the padding rows' part unused
        mask = mask[..., :m, :]
    # NOTE: the strides and counts are never specialized on (do_not_specialize), so that one
    # compiled program serves every launch; what Triton's specialization would have told the
    # compiler (strides that are multiples of 16, for vectorized loads) ALIGNED tells it
    # instead, by the head size alone: with a head size that is a multiple of 16, `_aligned`
    # makes every stride one (a copy for the odd tensor that is not; the paged path's never
    # need one: its rows are whole 16-position blocks), the mask's rows whole 16 keys, and
    # the strides are passed in units of 16. Checked on H100 code built ahead of time here:
    # bfloat16, head size 128: 18 vectorized loads instead of 152 scalar ones, no spills.
    aligned = d % 16 == 0
    unit = 16 if aligned else 1
    q, keys, values = (_aligned(x, aligned) for x in (q, keys.to(q.dtype), values.to(q.dtype)))
    if aligned and not _fits(mask, True):  # a copy whose rows are whole 16 keys (masked)
        mask = F.pad(mask, (0, -n % 16), value=float("-inf")).contiguous()
    mask = _aligned(mask, aligned).expand(b, h, m, mask.shape[-1])
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    dim_p2 = max(16, triton.next_power_of_2(d))
    tiles, chunks = triton.cdiv(m, BLOCK_M), max(1, triton.cdiv(n, CHUNK))
    if parallel is None:
        parallel = spread and chunks > 1 and b * h * tiles < PARALLEL_BELOW
    part = torch.empty(b * h * chunks * tiles, BLOCK_M, dim_p2 + 2, device=q.device, dtype=torch.float32) if parallel else out
    shape = dict(DIM=d, DIM_P2=dim_p2, BLOCK_M=BLOCK_M)
    # NOTE: no fused multiply-adds (enable_fp_fusion): `_merge` runs in two kernels, which must
    # round it alike, and the compiler fuses by context.
    options = dict(num_warps=4, enable_fp_fusion=False)
    width = positions.shape[-1] if positions is not None else 1
    if positions is not None and positions.stride(-1) != 1:
        positions = positions.contiguous()
    if sinks is not None:
        if sinks.dim() > 1 and sinks.shape[-2] not in (1, m):  # exact.attend's padded form
            sinks = sinks[..., :m, :]
        sinks = sinks.to(torch.float32).expand(b, h, m, 1).contiguous()
    _attend[(b * h, tiles, chunks if parallel else 1)](
        q, keys, values, mask, out, part, positions if positions is not None else q, sinks if sinks is not None else q,
        m, n, h, chunks, width, window or 0,
        _strides(positions)[0] if positions is not None else 0, float(scale), float(softcap or 1.0),
        *(st // unit for x in (q, keys, values, mask, out) for st in _strides(x)),
        BLOCK_N=BLOCK_N, CHUNK=CHUNK, PARALLEL=parallel, SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32, ALIGNED=aligned, BOUNDED=positions is not None,
        SINKS=sinks is not None, num_stages=2 if dim_p2 > 128 else 3, **shape, **options)
    if parallel:
        _combine[(b * h, tiles)](part, out, sinks if sinks is not None else out, m, h, chunks, *_strides(out), SINKS=sinks is not None, **shape, **options)
    return out


# -- linear layers ---------------------------------------------------------------------------
# The same rule for out = x @ w.T: every output is its row's inputs times its weight row, in
# BLOCK_K steps from the first, accumulated in float32 by one program that owns its tile; no
# split of the inputs between programs (split-K, stream-K), tile shapes fixed by the layer's
# shape. A row's place among the rows decides only which program computes it.

LINEAR_BLOCK_M = 64  # rows per program
LINEAR_BLOCK_K = 64  # inputs per step of a program's walk (in order, never split)
LINEAR_GROUP = 8  # row tiles that take column tiles in turn (the weight tile stays in L2)


@triton.jit(do_not_specialize=["rows"])
def _linear(x_ptr, w_ptr, b_ptr, out_ptr, rows, inputs, outputs,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
            BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Program: one BLOCK_M x BLOCK_N tile of out = x @ w.T (+ bias), its inputs walked in
    BLOCK_K steps from the first, accumulated in float32. x and out are contiguous: their row
    strides are `inputs` and `outputs`, which Triton specializes on (their divisibility lets
    it vectorize the loads), as they are the layer's own; the row count is never."""
    pid = tl.program_id(0)
    m_tiles, n_tiles = tl.cdiv(rows, BLOCK_M), tl.cdiv(outputs, BLOCK_N)
    first = pid // (GROUP * n_tiles) * GROUP  # grouped order: which program runs a tile, not what it computes
    height = tl.minimum(m_tiles - first, GROUP)
    tile_m = first + (pid % (GROUP * n_tiles)) % height
    tile_n = (pid % (GROUP * n_tiles)) // height
    r = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + r[:, None] * inputs + k[None, :], mask=(r[:, None] < rows) & (k[None, :] < inputs), other=0.0)
        w = tl.load(w_ptr + c[None, :] * inputs + k[:, None], mask=(c[None, :] < outputs) & (k[:, None] < inputs), other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if BIAS:
        acc = acc + tl.load(b_ptr + c, mask=c < outputs, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r[:, None] * outputs + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=(r[:, None] < rows) & (c[None, :] < outputs))


def linear_block_n(outputs: int) -> int:
    """Columns per program, by the layer's shape alone (never by the row count)."""
    return 128 if outputs >= 8192 else 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) ([..., in] -> [..., out]; weight [out, in] contiguous) as one
    launch whose every row is the same arithmetic at any place among any number of rows: an
    output is its row's inputs times its weight row, BLOCK_K at a time in order, accumulated in
    float32 (no split of the inputs among programs, tile shapes fixed by the layer's shape)."""
    inputs, outputs = weight.shape[1], weight.shape[0]
    rows = _dense(x.reshape(-1, inputs))
    out = torch.empty(rows.shape[0], outputs, device=x.device, dtype=x.dtype)
    block_n = linear_block_n(outputs)
    grid = (triton.cdiv(rows.shape[0], LINEAR_BLOCK_M) * triton.cdiv(outputs, block_n),)
    ieee = x.dtype == torch.float32
    _linear[grid](rows, _dense(weight), bias if bias is not None else weight, out, rows.shape[0], inputs, outputs,
                  BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=block_n, BLOCK_K=LINEAR_BLOCK_K // 2 if ieee else LINEAR_BLOCK_K, GROUP=LINEAR_GROUP,
                  BIAS=bias is not None, IEEE=ieee, num_warps=4, num_stages=3, enable_fp_fusion=False)
    return out.reshape(*x.shape[:-1], outputs)
