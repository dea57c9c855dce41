"""Paged attention: each row's queries attend its keys where the KV pool holds them, through
the row's block table, instead of gathering the whole bucket first. Decode rows (one query
each) and multi-token rows (prefill chunks, forced and drafted tokens: T queries each, padded
alike) run the same kernels.

Shapes (a KV head's G query heads folded with a row's T tokens, as server/engine/attention.py
folds them: query row g * T + t is head g at token t): q [B, Hkv, G * T, Dk]; the pool's keys
[Hkv, S, Dk] and values [Hkv, S, Dv] of one layer (S = (num_blocks + 1) * block_size slots;
an fp8 or int8 pool's one-byte codes, with a scale a slot: `QUANT`); tables [B, max_blocks];
positions [B] (T = 1) or [B, T] -> out [B, Hkv, G * T, Dv] in q's dtype. Position p of row b lives at slot tables[b, p // block_size] *
block_size + p % block_size; a query at position `pos` sees keys 0..pos (or 0..its reach: a
picture that attends to itself whole), or with `window` those after pos - window
(transformers' sliding rule), or with a negative one those of its own chunk of -window
positions (Llama 4's chunked attention: `kv.Layout`). Over an MLA latent pool (one KV head:
the rotary key as the key, the latent as the value) the absorbed query is [Dv | Dk] wide and
meets both (`mla.meet`): the kernel reads each position's latent once, as key and as value.

`torch.ops.kvserve.paged_attention` is an opaque custom op (a fake implementation gives
torch.compile its shape), so a compiled model calls it as it is, never specialising on the
pool. On CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1, tests), it runs the
Triton kernels below; elsewhere `paged_attention_reference`, the eager formula in float32.

A program is one (row, KV head), one tile of its query rows (`launch_constants`: at most
ACCUMULATOR / Dv of them, more make more programs) and one split of the row's context: its
keys in tiles of BLOCK_N positions (a table look-up per position, so any block size works),
FlashAttention's online softmax in float32. Only the tiles holding keys some query of the
tile can see are walked (from the earliest window's start to the latest position), each
query masked to its own: the cost follows the tokens a row holds, not the bucket's
max_blocks. A long context is split over several programs each walking a range of tiles
(flash-decoding), whose partial states (max, sum, weighted values) a second small kernel
merges, then adds the sinks (gpt-oss: a logit per query head in the denominator, no value).
The split count depends on the static shapes only (B, Hkv, G * T, max_blocks, `splits`), so a
CUDA graph captured for a bucket replays the same launches whatever the positions.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from cache_manager import kv
from server.engine import context

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton (or a broken one): the op runs the reference
    triton = tl = None

TRITON = triton is not None
# NOTE: triton.jit decides at decoration whether a kernel is compiled or interpreted, so what
# counts is TRITON_INTERPRET at import time, not at the call.
INTERPRETED = TRITON and os.environ.get("TRITON_INTERPRET") == "1"

# how the kernel reads a pool of each KV format (`kv.KV_DTYPES`): as stored, float8 e4m3 codes
# or int8 codes, each times its slot's scale
QUANT = {"auto": 0, "fp8": 1, "int8": 2}

BLOCK_N = 32  # key positions per step of a program's walk
PARTITION = 512  # the fewest key positions a split walks (below that, merging costs more than it spreads)
TARGET_PROGRAMS = 1024  # splits stop once a launch has this many programs (enough to fill a GPU)
# the most float32 accumulator elements one program holds (its query heads x the value width):
# 64 registers a thread at 8 warps. An MLA latent pool folds all of a model's heads onto its one
# KV head (DeepSeek-V3: 128 over a 512-wide latent); held at 64 heads a program, its accumulator
# spilled 4 KB of registers a thread in bf16 (sm_90 code built ahead of time: bench.kernel_resources),
# and at 128 it asked more shared memory than an H200 has. More heads: more programs.
ACCUMULATOR = 16384
# ... and in float32 at most this many heads: its IEEE dots run on the FMA units, whose tiles
# spill past it (16 KB a thread at 128 heads of width 128)
IEEE_HEADS = 32

_jit = triton.jit if TRITON else (lambda fn: fn)


@_jit
def _attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, pos_ptr, reach_ptr, out_ptr, top_ptr, total_ptr, acc_ptr, sink_ptr,
               heads, groups, width, block_size, max_tokens, tiles_per_split, window, scale, softcap,
               q_b, q_h, q_m, k_h, k_s, v_h, v_s, ks_h, vs_h, t_b, p_b, p_t, r_b, r_t, o_b, o_h, o_m,
               DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr, DV_P2: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, IEEE: tl.constexpr,
               UPCAST: tl.constexpr, LATENT: tl.constexpr, QUANT: tl.constexpr):
    """Program (row x KV head, split, tile of BLOCK_M query rows): the key tiles of the split's
    range that some query of the tile sees. SPLIT: its state goes to the partial buffers
    [B * Hkv, splits, query rows padded to whole tiles(, DV_P2)] for `_merge_splits`;
    otherwise (one split) it adds the sinks and writes the output. LATENT: an MLA latent pool
    (`mla.meet`): the query is [DV | DK] wide and meets each position's value (the latent) and
    key (the rotary key) side by side, so a tile's values are read once for both products.
    QUANT: a quantized pool's codes (`_dequantized`), each times its slot's scale (`ks_ptr`,
    `vs_ptr`: [Hkv, S], a slot's scale at stride 1)."""
    row = tl.program_id(0).to(tl.int64)
    b, h = row // heads, row % heads
    split = tl.program_id(1).to(tl.int64)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = m < groups * width
    first, last = _visible(pos_ptr + b * p_b, reach_ptr + b * r_b, m % width, p_t, r_t, live, max_tokens, window)
    earliest, latest = tl.min(first, 0), tl.max(last, 0)  # the keys some query of the tile sees
    lo = tl.maximum(earliest // BLOCK_N, split * tiles_per_split)
    hi = tl.minimum(latest // BLOCK_N + 1, (split + 1) * tiles_per_split)
    dk = tl.arange(0, DK_P2)
    dv = tl.arange(0, DV_P2)
    q_base = q_ptr + b * q_b + h * q_h + m[:, None] * q_m
    if LATENT:
        q_latent = tl.load(q_base + dv[None, :], mask=live[:, None] & (dv[None, :] < DV), other=0.0)
        q = tl.load(q_base + DV + dk[None, :], mask=live[:, None] & (dk[None, :] < DK), other=0.0)
    else:
        q = tl.load(q_base + dk[None, :], mask=live[:, None] & (dk[None, :] < DK), other=0.0)
    k_base, v_base = k_ptr + h * k_h, v_ptr + h * v_h
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P2], tl.float32)
    for tile in range(lo, hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        read = (keys >= earliest) & (keys <= latest)
        block = tl.load(table_ptr + b * t_b + keys // block_size, mask=read, other=0).to(tl.int64)
        slot = block * block_size + keys % block_size
        kt = tl.load(k_base + slot[None, :] * k_s + dk[:, None], mask=read[None, :] & (dk[:, None] < DK), other=0)
        if QUANT:
            kt = _dequantized(kt, tl.load(ks_ptr + h * ks_h + slot, mask=read, other=0.0)[None, :], QUANT)
        kt = kt.to(q.dtype)
        v_ptrs, v_mask = v_base + slot[:, None] * v_s + dv[None, :], read[:, None] & (dv[None, :] < DV)
        if LATENT:  # the latent is a key too: read before the scores, once
            v = _values(v_ptrs, v_mask, vs_ptr + h * vs_h + slot, read, QUANT).to(q.dtype)
            scores = (_dot(q_latent, tl.trans(v), IEEE, UPCAST) + _dot(q, kt, IEEE, UPCAST)) * scale
        else:
            scores = _dot(q, kt, IEEE, UPCAST) * scale
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh through exp(-2|x|)
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            t = (1.0 - e) / (1.0 + e)
            scores = softcap * tl.where(scores < 0, -t, t)
        seen = (keys[None, :] >= first[:, None]) & (keys[None, :] <= last[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # nothing seen yet: weights 0, not NaN
        rescale = tl.exp(top - shift)
        weights = tl.exp(scores - shift[:, None])
        total = total * rescale + tl.sum(weights, 1)
        if not LATENT:  # the values read where the weights are ready, as before the latent form
            v = _values(v_ptrs, v_mask, vs_ptr + h * vs_h + slot, read, QUANT).to(q.dtype)
        acc = acc * rescale[:, None] + _dot(weights.to(v.dtype), v, IEEE, UPCAST)
        top = new_top
    if SPLIT:
        part = (row * tl.num_programs(1) + split) * (tl.num_programs(2) * BLOCK_M) + m
        tl.store(top_ptr + part, top)
        tl.store(total_ptr + part, total)
        tl.store(acc_ptr + part[:, None] * DV_P2 + dv[None, :], acc)
    else:
        _finish(out_ptr + b * o_b + h * o_h, sink_ptr + h * groups, m, m // width, dv, live, top, total, acc, o_m, DV, SINKS)


@_jit
def _merge_splits(pos_ptr, reach_ptr, out_ptr, top_ptr, total_ptr, acc_ptr, sink_ptr, heads, groups, width, splits, max_tokens,
                  tiles_per_split, window, p_b, p_t, r_b, r_t, o_b, o_h, o_m,
                  DV: tl.constexpr, DV_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINKS: tl.constexpr):
    """Program (row x KV head, tile of BLOCK_M query rows): the states of the splits that some
    query of the tile saw keys in, merged, then the sinks and the output. The others were never
    walked: their buffers are not read (a query that saw nothing in a walked split left a state
    of no weight there)."""
    row = tl.program_id(0).to(tl.int64)
    b, h = row // heads, row % heads
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = m < groups * width
    first, last = _visible(pos_ptr + b * p_b, reach_ptr + b * r_b, m % width, p_t, r_t, live, max_tokens, window)
    dv = tl.arange(0, DV_P2)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P2], tl.float32)
    for split in range(tl.min(first, 0) // BLOCK_N // tiles_per_split, tl.max(last, 0) // BLOCK_N // tiles_per_split + 1):
        part = (row * splits + split) * (tl.num_programs(1) * BLOCK_M) + m
        s_top = tl.load(top_ptr + part)
        new_top = tl.maximum(top, s_top)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        mine, theirs = tl.exp(top - shift), tl.exp(s_top - shift)
        total = total * mine + tl.load(total_ptr + part) * theirs
        acc = acc * mine[:, None] + tl.load(acc_ptr + part[:, None] * DV_P2 + dv[None, :]) * theirs[:, None]
        top = new_top
    _finish(out_ptr + b * o_b + h * o_h, sink_ptr + h * groups, m, m // width, dv, live, top, total, acc, o_m, DV, SINKS)


@_jit
def _values(ptrs, mask, scale_ptrs, read, QUANT: tl.constexpr):
    """A tile's values [BLOCK_N, DV_P2] (dequantized by their slots' scales where QUANT)."""
    v = tl.load(ptrs, mask=mask, other=0)
    if QUANT:
        v = _dequantized(v, tl.load(scale_ptrs, mask=read, other=0.0)[:, None], QUANT)
    return v


@_jit
def _dequantized(codes, scale, QUANT: tl.constexpr):
    """A quantized pool's codes times their scales, in float32 (`kv._Scaled`: the product the
    gathered way rounds to the compute dtype, made exactly here and rounded by the caller).
    QUANT 1: float8 e4m3 bits stored as uint8, decoded by integer ops as `kv.e4m3_as_half`
    decodes them (sign, exponent and mantissa moved into float16's places: 1/256 of the value,
    subnormals included), so no float8 type is needed on the card or in the interpreter;
    QUANT 2: int8."""
    if QUANT == 1:
        bits = codes.to(tl.int8, bitcast=True).to(tl.int32)
        half = ((bits << 7) & -16512).to(tl.int16).to(tl.float16, bitcast=True)
        x = half.to(tl.float32) * 256.0
    else:
        x = codes.to(tl.float32)
    return x * scale.to(tl.float32)


@_jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 products for float32 (not TF32); UPCAST: the
    operands in float32 first (NOTE: Triton 3.9's interpreter keeps bfloat16 as uint16 and
    its tl.dot multiplies those integers, so under it bfloat16 is multiplied as float32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@_jit
def _visible(pos_base, reach_base, token, p_t, r_t, live, max_tokens, window):
    """The first and last key position each query row sees, by the position and the reach of
    its `token` (the row's at `pos_base` and `reach_base`; window 0: none; > 0 sliding, < 0
    chunked: `context.first_visible`); the last within the bucket, so a bad position never
    reads past its table. A query row that is not `live` sees nothing (its first past its
    last), so it widens no tile's walk."""
    pos = tl.load(pos_base + token * p_t, mask=live, other=0).to(tl.int64)
    reach = tl.load(reach_base + token * r_t, mask=live, other=0).to(tl.int64)
    last = tl.minimum(reach, max_tokens - 1)
    chunk = tl.maximum(-window, 1)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), tl.where(window < 0, pos - pos % chunk, 0))
    return tl.where(live, first, max_tokens), tl.where(live, last, -1)


@_jit
def _finish(out_base, sink_base, m, head, dv, live, top, total, acc, o_m, DV: tl.constexpr, SINKS: tl.constexpr):
    """The output of query rows `m`: the weighted values over the sum of weights, with the sink
    logit of each row's query `head` in the sum (SINKS; the max taken with it, so no weight
    overflows)."""
    if SINKS:
        sink = tl.load(sink_base + head, mask=live, other=0.0).to(tl.float32)
        new_top = tl.maximum(top, sink)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        mine = tl.exp(top - shift)
        total = total * mine + tl.exp(sink - shift)
        acc = acc * mine[:, None]
    out = acc / tl.where(live & (total > 0), total, 1.0)[:, None]
    tl.store(out_base + m[:, None] * o_m + dv[None, :], out.to(out_base.dtype.element_ty), mask=live[:, None] & (dv[None, :] < DV))


@_jit
def _store(key_ptr, value_ptr, keys_ptr, values_ptr, ks_ptr, vs_ptr, slot_ptr, kn_h, kn_b, vn_h, vn_b, k_h, k_s, v_h, v_s, ks_h, vs_h,
           slot_b, DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr, DV_P2: tl.constexpr, QUANT: tl.constexpr):
    """Program (token, KV head): the token's new key and value into the pool at its slot,
    quantized where QUANT (their scales into `ks_ptr` / `vs_ptr` [Hkv, S] as bf16 bits)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + b * slot_b).to(tl.int64)
    _put(key_ptr + h * kn_h + b * kn_b, keys_ptr + h * k_h + slot * k_s, ks_ptr + h * ks_h + slot, DK, DK_P2, QUANT)
    _put(value_ptr + h * vn_h + b * vn_b, values_ptr + h * v_h + slot * v_s, vs_ptr + h * vs_h + slot, DV, DV_P2, QUANT)


@_jit
def _put(source, target, scale_target, D: tl.constexpr, D_P2: tl.constexpr, QUANT: tl.constexpr):
    """One vector of D values from `source` to `target`, as stored: as it is, or (QUANT) as
    `kv._Scaled.encode` makes it, bit for bit: the scale amax(|x|) / qmax (at least
    `kv._MIN_SCALE`) rounded to bf16, then each x / scale (int8: rounded half to even), clamped
    to +-qmax, as a one-byte code. The divisions are IEEE's (`div_rn`, as torch's), the
    roundings written in integer ops, so the codes are torch's on the card and in the interpreter."""
    d = tl.arange(0, D_P2)
    x = tl.load(source + d, mask=d < D, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        qmax = 448.0 if QUANT == 1 else 127.0
        scale_bits, scale = _bf16(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), qmax), 1e-30))
        tl.store(scale_target, scale_bits)
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        if QUANT == 2:
            y = _rint(y)
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:
            tl.store(target + d, _e4m3(y).to(tl.uint8), mask=d < D)
        else:
            tl.store(target + d, y.to(tl.int8), mask=d < D)
    else:
        tl.store(target + d, x, mask=d < D)


@_jit
def _bf16(x):
    """Float32 `x` (positive, finite) rounded to bfloat16, to nearest even: (its bits as int16,
    its value as float32)."""
    bits = x.to(tl.int32, bitcast=True)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return high.to(tl.int16), (high << 16).to(tl.float32, bitcast=True)


@_jit
def _rint(x):
    """Float32 `x` (|x| < 2**22) rounded to an integer, half to even (torch's `round`)."""
    r = tl.floor(x + 0.5)
    odd = r - 2.0 * tl.floor(r * 0.5) != 0.0
    return tl.where((r - x == 0.5) & odd, r - 1.0, r)


@_jit
def _e4m3(y):
    """Float32 `y` (|y| <= 448) as float8 e4m3fn bits (int32 0..255), rounded to nearest even as
    torch converts: normal values by rounding the mantissa to 3 bits (a carry moves the exponent
    on), those under 2**-6 as multiples of 2**-9."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)  # exponent bias 127 -> 7, and 3 mantissa bits
    a = magnitude.to(tl.float32, bitcast=True)
    subnormal = _rint(a * 512.0).to(tl.int32)
    return tl.where(a < 0.015625, subnormal, normal) | sign


def split_count(batch: int, kv_heads: int, max_blocks: int, block_size: int, partition: int = PARTITION, row_tiles: int = 1) -> int:
    """How many programs share a row's context: one per `partition` key positions of the
    bucket, fewer where the rows alone (B x Hkv x `row_tiles`, the tiles of a KV head's query
    rows) make TARGET_PROGRAMS programs. Static shapes only (a CUDA graph's launch grid must
    not depend on the positions)."""
    tiles = triton.cdiv(max_blocks * block_size, BLOCK_N)
    by_length = triton.cdiv(tiles * BLOCK_N, max(partition, BLOCK_N))
    by_fill = triton.cdiv(TARGET_PROGRAMS, batch * kv_heads * row_tiles)
    return max(1, min(by_length, by_fill, tiles))


def paged_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                           block_size: int, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                           window: int | None = None, reach: torch.Tensor | None = None, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None, kv_format: str = "auto", splits: int | None = None) -> torch.Tensor:
    """`paged_attention` by the Triton kernels (one launch, or two when split: `launches`)."""
    out, steps = launches(q, keys, values, tables, positions, block_size, scale, softcap, sinks, window, reach, key_scales, value_scales,
                          kv_format, splits)
    for step in steps:
        step.kernel[step.grid](*step.args, **step.constants)
    return out


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **constants)`."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constants: dict


def launches(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
             block_size: int, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
             window: int | None = None, reach: torch.Tensor | None = None, key_scales: torch.Tensor | None = None,
             value_scales: torch.Tensor | None = None, kv_format: str = "auto", splits: int | None = None) -> tuple[torch.Tensor, list[Launch]]:
    """The output [B, Hkv, G * T, Dv] of `paged_attention` and the launches that fill it:
    `_attention`, then `_merge_splits` where the context is split (`splits`: how many programs
    share a row's context, default `split_count`'s). bench/kernel_resources.py builds these same
    launches ahead of time for an H200."""
    b, kv_heads, rows, _ = q.shape
    width = 1 if positions.dim() == 1 else positions.shape[1]
    groups = rows // width
    dk, dv = keys.shape[-1], values.shape[-1]
    latent = _latent(q, keys, values)
    max_blocks = tables.shape[1]
    reach = positions if reach is None else reach
    quant = QUANT[kv_format]
    if quant and (key_scales is None or value_scales is None):
        raise ValueError(f"a {kv_format} pool is read with its scales")
    q, keys, values, tables = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys, values, tables))
    out = torch.empty(b, kv_heads, rows, dv, device=q.device, dtype=q.dtype)
    if b == 0:
        return out, []
    if quant:
        key_scales, value_scales = (x if x.stride(-1) == 1 else x.contiguous() for x in (key_scales, value_scales))
    else:
        key_scales = value_scales = keys  # unused
    attend, merge = launch_constants(rows, dk, dv, q.dtype, latent=latent, split=False, softcap=softcap is not None, sinks=sinks is not None,
                                     quant=quant)
    row_tiles = triton.cdiv(rows, attend["BLOCK_M"])
    splits = splits or split_count(b, kv_heads, max_blocks, block_size, row_tiles=row_tiles)
    tiles = triton.cdiv(max_blocks * block_size, BLOCK_N)
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # none left empty by the rounding
    attend["SPLIT"] = split = splits > 1
    if split:
        top = torch.empty(b * kv_heads * splits * row_tiles * attend["BLOCK_M"], device=q.device, dtype=torch.float32)
        total = torch.empty_like(top)
        acc = torch.empty(top.shape[0], attend["DV_P2"], device=q.device, dtype=torch.float32)
    else:
        top = total = acc = out  # unused
    sink = sinks.to(device=q.device, dtype=torch.float32).reshape(kv_heads, groups).contiguous() if sinks is not None else out
    window = window or 0
    # positions and reach [B] (one token a row: its stride 0) or [B, T]
    where = (positions, reach, *(s for x in (positions, reach) for s in (x.stride(0), x.stride(1) if x.dim() > 1 else 0)))
    steps = [Launch(_attention, (b * kv_heads, splits, row_tiles),
                    (q, keys, values, key_scales, value_scales, tables, positions, reach, out, top, total, acc, sink,
                     kv_heads, groups, width, block_size, max_blocks * block_size, tiles_per_split, window, float(scale), float(softcap or 1.0),
                     *q.stride()[:3], *keys.stride()[:2], *values.stride()[:2], key_scales.stride(0), value_scales.stride(0),
                     tables.stride(0), *where[2:], *out.stride()[:3]),
                    attend)]
    if split:
        steps.append(Launch(_merge_splits, (b * kv_heads, row_tiles),
                            (*where[:2], out, top, total, acc, sink, kv_heads, groups, width, splits, max_blocks * block_size,
                             tiles_per_split, window, *where[2:], *out.stride()[:3]), merge))
    return out, steps


def launch_constants(rows: int, dk: int, dv: int, dtype: torch.dtype, *, latent: bool, split: bool, softcap: bool,
                     sinks: bool, quant: int = 0) -> tuple[dict, dict]:
    """The compile-time constants and launch options of `_attention` and of `_merge_splits` for
    a KV head's `rows` query rows (its G query heads x the row's T tokens) over keys dk and
    values dv wide in `dtype`, stored as `quant` says (`QUANT`) (`launches`)."""
    ieee = dtype == torch.float32
    dk_p2, dv_p2 = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    # at most an accumulator of ACCUMULATOR elements (and IEEE_HEADS in float32), at least tl.dot's smallest tile
    heads = min(triton.next_power_of_2(rows), ACCUMULATOR // dv_p2)
    block_m = max(16, min(heads, IEEE_HEADS) if ieee else heads)
    # NOTE: float32's IEEE dots run on the FMA units, not tensor cores: with 4 warps their tiles
    # spill registers (sm_90 code built ahead of time), with 8 they fit; so does an accumulator
    # past 64 registers a thread at 4 warps
    warps = 8 if ieee or block_m * dv_p2 > ACCUMULATOR // 2 else 4
    merge = dict(DV=dv, DV_P2=dv_p2, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SINKS=sinks, num_warps=warps)
    attend = dict(merge, DK=dk, DK_P2=dk_p2, SPLIT=split, SOFTCAP=softcap, IEEE=ieee, UPCAST=INTERPRETED and dtype == torch.bfloat16,
                  LATENT=latent, QUANT=quant, num_stages=2)
    return attend, merge


def paged_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                              block_size: int, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                              window: int | None = None, reach: torch.Tensor | None = None, key_scales: torch.Tensor | None = None,
                              value_scales: torch.Tensor | None = None, kv_format: str = "auto") -> torch.Tensor:
    """`paged_attention` as the eager formula in float32 over keys and values gathered by the
    tables (the bucket's every position, masked), dequantized as the pool's gather does."""
    b, kv_heads, rows, _ = q.shape
    width = 1 if positions.dim() == 1 else positions.shape[1]
    groups = rows // width
    offsets = torch.arange(block_size, device=tables.device)
    slots = (tables[:, :, None] * block_size + offsets).flatten(1)  # [B, L]
    fmt = kv.kv_format(kv_format)
    # [B, Hkv, L, D]: the products of codes and scales rounded to the queries' dtype, as the kernel rounds them
    k_rows, v_rows = (kv.read_vectors(fmt, x, s, slots, q.dtype).transpose(0, 1).float()
                      for x, s in ((keys, key_scales), (values, value_scales)))
    if _latent(q, keys, values):
        k_rows = torch.cat([v_rows, k_rows], dim=-1)
    scores = torch.matmul(q.float(), k_rows.transpose(-2, -1)) * scale  # [B, Hkv, G * T, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # query row g * T + t: token t's position, for each of the G heads
    per_row = [None if x is None else x.view(b, width).repeat(1, groups)[:, :, None] for x in (positions, reach)]
    allowed = context.visible(torch.arange(slots.shape[1], device=q.device)[None, None, :], per_row[0], window, per_row[1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, kv_heads, groups, 1).repeat_interleave(width, dim=2).expand(b, kv_heads, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v_rows).to(q.dtype)


def _latent(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the pool is an MLA latent one: queries as wide as a value and a key side by side
    (`mla.meet`'s rule), where any other pool's are as wide as a key."""
    if q.shape[-1] == keys.shape[-1]:
        return False
    if q.shape[-1] != values.shape[-1] + keys.shape[-1]:
        raise ValueError(f"queries {q.shape[-1]} wide meet neither keys {keys.shape[-1]} wide nor a latent of "
                         f"{values.shape[-1]} and a rotary key of {keys.shape[-1]}")
    return True


def runs_triton(device: torch.device) -> bool:
    """Whether the op runs the Triton kernels for tensors on `device`: on CUDA, and on CPU
    under the interpreter (set before this module was imported, and still set)."""
    if not TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("kvserve::store_kv", mutates_args=("keys", "values", "key_scales", "value_scales"))
def store_kv(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
             key_scales: torch.Tensor | None, value_scales: torch.Tensor | None, kv_format: str) -> None:
    """N tokens' new key [Hkv, N, Dk] and value [Hkv, N, Dv] into one layer's pool storage
    `keys` [Hkv, S, Dk] / `values` [Hkv, S, Dv] at `slots` [N], in the pool's `kv_format` (fp8
    or int8: codes there and a scale a slot in `key_scales` / `value_scales` [Hkv, S]): the K
    and V stores of a step in one Triton launch where the kernels run (`runs_triton`), with the
    codes and scales `kv.put_kv` makes, bit for bit; elsewhere `kv.put_kv` itself.

    NOTE: no defaults: torch 2.11 (the GPU machine's) fails on a mutated argument left to its
    default (its ADInplaceOrView kernel indexes the arguments passed)."""
    if not runs_triton(key.device):
        kv.put_kv(kv.kv_format(kv_format), keys, values, key_scales, value_scales, slots, key, value)
        return
    if key.shape[1]:
        step = store_launch(key, value, keys, values, slots, key_scales, value_scales, kv_format)
        step.kernel[step.grid](*step.args, **step.constants)


def store_launch(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 key_scales: torch.Tensor | None, value_scales: torch.Tensor | None, kv_format: str) -> Launch:
    """The one launch of `store_kv` (bench/kernel_resources.py builds it ahead of time too)."""
    kv_heads, b, dk = key.shape
    dv = value.shape[-1]
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    # scales as their bf16 bits (the kernel rounds them itself); unused for a plain pool
    quant = QUANT[kv_format]
    ks, vs = (key_scales.view(torch.int16), value_scales.view(torch.int16)) if quant else (keys, values)
    return Launch(_store, (b, kv_heads), (key, value, keys, values, ks, vs, slots, *key.stride()[:2], *value.stride()[:2], *keys.stride()[:2],
                                          *values.stride()[:2], ks.stride(0), vs.stride(0), slots.stride(0)),
                  dict(DK=dk, DV=dv, DK_P2=triton.next_power_of_2(dk), DV_P2=triton.next_power_of_2(dv), QUANT=quant))


@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                    block_size: int, scale: float, softcap: float | None, sinks: torch.Tensor | None, window: int | None,
                    reach: torch.Tensor | None = None, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                    kv_format: str = "auto") -> torch.Tensor:
    """q [B, Hkv, G * T, Dk] over one layer's pool keys [Hkv, S, Dk] / values [Hkv, S, Dv]
    through `tables` [B, max_blocks] at `positions` [B] (T = 1) or [B, T] (see the module
    docstring; `reach` as positions: the last position each token sees, its own by default)
    -> [B, Hkv, G * T, Dv] in q's dtype. A quantized pool (`kv_format` fp8 or int8) holds codes
    in `keys` / `values` and a scale a slot in `key_scales` / `value_scales` [Hkv, S]. Padding
    rows (position 0, a table of trash blocks) give finite values."""
    args = (q, keys, values, tables, positions, block_size, scale, softcap, sinks, window, reach, key_scales, value_scales, kv_format)
    return (paged_attention_triton if runs_triton(q.device) else paged_attention_reference)(*args)


@paged_attention.register_fake
def _(q, keys, values, tables, positions, block_size, scale, softcap, sinks, window, reach=None, key_scales=None, value_scales=None,
      kv_format="auto"):
    return q.new_empty(*q.shape[:-1], values.shape[-1])
