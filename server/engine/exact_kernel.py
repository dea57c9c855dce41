"""Exact mode's paged attention as one Triton kernel (server/engine/exact.py `attend`'s contract):
each query's result is the same bits whatever else the launch computes.

Why a kernel: cuBLAS picks a matmul kernel by shape (rows, columns, reduction length, batch
count). A decode step's few-row score matmul and a prefill chunk's thousands of rows can take
different kernels, one of which splits the reduction across warps ("sliced-K"), so a position
decoded would round differently from the same position prefilled. Here every launch runs one
compiled program, whose tile shapes are compile-time constants fixed by the head size alone.

A program is one KV head of one row and BLOCK_M query rows (a KV head's query heads side by
side, as the paged path folds them). It walks the keys from position 0 in blocks of BLOCK_N,
always in that order, with FlashAttention's online softmax (a running max and sum per query).
A query's result then depends only on its own query vector, its keys and values and its mask
row:

* its scores and its share of P @ V are rows of tile matmuls, and a matmul's rows never mix;
* a block the query cannot see (past it, before its window, past the row's end) changes
  nothing: its weights are exactly 0 and the running state is rescaled by exp(0) = 1, and a
  block that no query of the tile can see is skipped altogether (the same no-op);
* the number of rows, queries, keys and programs are runtime arguments, never specialized on
  (`do_not_specialize`): they decide how many programs run, not what one computes.

Keys sit at their absolute positions (the paged gather starts at position 0), so a query's
blocks and the mask inside each are the same in every launch. Arithmetic is float32 (the
matmuls accumulate in it; in bf16/fp16 the weights are rounded to the values' dtype before
P @ V, as FlashAttention does); float32 models use IEEE float32 matmuls, not TF32.

Triton compiles the kernel on its first launch (seconds; `exact.pin_backends` does it at start-up).
Off a GPU, Triton's interpreter (TRITON_INTERPRET=1) runs the same kernel with NumPy:
tests/server/test_exact_kernel.py checks it on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query rows per program (tl.dot's smallest tile)
BLOCK_N = 64  # keys per step of a program's walk


@triton.jit(do_not_specialize=["queries", "keys", "heads", "q_b", "q_h", "q_m", "k_b", "k_h", "k_n", "v_b", "v_h", "v_n", "m_b", "m_h", "m_m", "o_b", "o_h", "o_m"])
def _attend(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, queries, keys, heads, scale, softcap,
            q_b, q_h, q_m, k_b, k_h, k_n, v_b, v_h, v_n, m_b, m_h, m_m, o_b, o_h, o_m,
            DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, h = row // heads, row % heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_P2)
    live = rows < queries
    q = tl.load(q_ptr + b * q_b + h * q_h + rows[:, None] * q_m + dims[None, :], mask=live[:, None] & (dims[None, :] < DIM), other=0.0)
    k_base, v_base = k_ptr + b * k_b + h * k_h, v_ptr + b * v_b + h * v_h
    m_base = mask_ptr + b * m_b + h * m_h + rows[:, None] * m_m
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    for start in range(0, keys, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < keys
        # padding rows and keys past the end see nothing: -inf
        bias = tl.load(m_base + cols[None, :], mask=live[:, None] & inside[None, :], other=float("-inf")).to(tl.float32)
        if tl.max(tl.max(bias, 1), 0) > float("-inf"):  # a block no query of the tile sees: a no-op, skipped
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
    out = acc / tl.where(live, total, 1.0)[:, None]  # padding rows saw nothing: 0, not 0 / 0
    tl.store(out_ptr + b * o_b + h * o_h + rows[:, None] * o_m + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (dims[None, :] < DIM))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """`exact.attend` as one kernel launch: q [B, Hkv, M, D], keys/values [B, Hkv, L, D] (any
    L; key i at position i), `mask` additive (0 / -inf) broadcastable to [B, Hkv, M, L] (or
    [.., query_rows(M), L]), every query seeing at least one key. Returns [B, Hkv, M, D] in
    q's dtype."""
    b, h, m, d = q.shape
    n = keys.shape[2]
    if mask.shape[-2] not in (1, m):  # exact.attend's padded form: the padding rows' part unused
        mask = mask[..., :m, :]
    mask = mask.expand(b, h, m, n)
    q, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys.to(q.dtype), values.to(q.dtype)))
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    dim_p2 = max(16, triton.next_power_of_2(d))
    grid = (b * h, triton.cdiv(m, BLOCK_M))
    _attend[grid](q, keys, values, mask, out, m, n, h, float(scale), float(softcap or 1.0),
                  *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *mask.stride()[:3], *out.stride()[:3],
                  DIM=d, DIM_P2=dim_p2, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SOFTCAP=softcap is not None,
                  IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2 if dim_p2 > 128 else 3)
    return out
