"""Exact mode (`--deterministic`): the numerics that make a row's logits independent of the
rest of its step, bit for bit.

A row's logits normally depend on more than its own tokens: the linear layers see every row of
the step (their kernels pick blockings by the row count M), and attention sees a prefill
chunk's other queries and however many keys the call reads, so a position computed in a chunk
of 512, in a chunk of 16, as a drafted token or as a decode step rounds differently. In exact
mode every op that reduces is made to reduce in an order fixed by the row's own content and
absolute positions (the "batch invariance" of Thinking Machines' "Defeating Nondeterminism in
LLM Inference", vLLM's batch-invariant mode and SGLang's deterministic inference):

* attention, two ways with one rule: a query's attention call is the same computation
  (the same keys, the same read length, the same mask row, whole tiles of `Q_TILE` query
  rows) wherever the query is computed.
  - The row path (CPU; server/engine/attention.py `_attend_exact`): queries in spans of `SPAN`
    positions aligned to position 0; each span is one plain attention call (SDPA, or the
    eager soft-capped formula) over keys 0 (or the window's first, rounded down to a span) to
    the end of the span, the queries zero-padded to whole tiles. A query at position p always
    reads keys up to the end of p's span, masked past p, whether it is decoded, drafted,
    forced or prefilled in a chunk of any size; the kernel rounds a row alike whatever the
    call's query count once that is whole tiles of 4 (measured: the NOTE on
    `_attend_exact`). The model's own dtype; the cost is about SDPA's.
  - The paged path (CUDA's; `attend`): one call for many rows of different lengths, so the
    read length cannot be a query's own. On CUDA, one Triton kernel launch
    (server/engine/exact_kernel.py): a program per KV head, row and tile of query rows walks
    the keys from position 0 in fixed blocks with an online softmax; tile shapes are fixed by
    the head size, so a query's arithmetic never depends on the launch's shape. Elsewhere
    (CPU, when asked for; CUDA without Triton) the torch formulation: float32 scores over
    keys in whole blocks of `KV_BLOCK` positions aligned to position 0 (zero-padded past the
    last key); a softmax over the row (on CPU one sequential accumulation; elsewhere max,
    exp and each block's own sum), then each block's P @ V over its fixed KV_BLOCK keys, the
    blocks added in position order (`_in_order`). Either way keys past a query (the rest of
    its block, the rest of a chunk, padding) weigh exactly 0, and adding exact zeros changes
    nothing, so a query's result depends only on its own query vector and keys 0..p, never
    on the query count or the read length.
* linear layers (`linear`, called by server/engine/cpu_linear.py's forwards and `enable`'s): rows
  zero-padded to whole tiles, so every call is a shape whose kernel rounds each row alike;
  off CPU `enable` checks each layer shape's tile call at start-up (`tiles_invariant`: a
  row's bits at every place in the tile) and computes a shape that fails with the Triton
  linear kernel (server/engine/exact_kernel.py), invariant by construction.
* normalization layers (`norm`): on CUDA one call per fixed tile of rows, as PyTorch's CUDA
  reduction lays its threads out by the row count; on CPU they are already per row.
* other row-wise ops (RoPE, SiLU, softmax/log-softmax over the vocabulary, sampling) are
  already per row (measured, docs/architecture.md; the engine tests cover them end to end);
  on CUDA a vocabulary softmax's rows are padded to whole 16 bytes and top-p sums in
  integers, in both modes (server/engine/sampling.py `softmax_rows`, `_mass_before_fixed`).
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from server.engine import context

KV_BLOCK = 256  # `attend` reduces keys in blocks of this many positions, aligned to position 0
SPAN = 16  # the row path attends queries in spans of this many positions, aligned to position 0
Q_TILE = 4  # attention computes whole tiles of this many query rows (zero-padded)
ROW_TILE = 8  # linear layers compute whole tiles of this many rows (the last one zero-padded)
CUDA_ROW_TILE = 64  # ... on CUDA, one cuBLAS call per tile
NORM_TILE_ELEMENTS = 2**18  # off CPU a norm layer's call covers about this many values (`norm_tile`)

log = logging.getLogger(__name__)


def aligned(n: int, block: int = KV_BLOCK) -> int:
    """n rounded up to a whole number of key blocks."""
    return -(-n // block) * block


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None,
           positions: torch.Tensor | None = None, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention whose result for each query is independent of the other queries and of
    how many keys past it are read: the device's kernel (`KERNELS`), else the torch
    formulation below.

    q [B, Hkv, M, D] (a KV head's query heads folded into M); keys/values [B, Hkv, L, D], key
    i at position i; `mask` additive (0 / -inf), broadcastable to [B, Hkv, M, L] (or to [B,
    Hkv, aligned(M, Q_TILE), L]: `query_rows`), every query seeing at least one key. Returns
    [B, Hkv, M, D] in q's dtype; the arithmetic is float32 whatever the model's dtype.
    `positions` [B, T] and `window`: where the mask comes from (query row r of row b at
    positions[b, r % T], causal, within `window`), which lets the kernel skip the blocks a
    whole tile of queries cannot see; the torch formulation reads the mask alone.
    `sinks` (gpt-oss's attention sinks): one logit per query row, broadcastable to [B, Hkv,
    M, 1] (or [.., query_rows(M), 1]; any float dtype, used in float32), that joins the
    softmax's denominator and carries no value: softmax over [scores, sink], the sink's
    weight dropped (transformers' gpt_oss `eager_attention_forward`); not soft-capped. The
    caller spreads a query head's sink over its folded rows (row r of KV head h is query
    head h * groups + r // T). The sink weighs in once, after every key, the same way in
    every call, so a query's result stays its own; without sinks the bits are as before.

    NOTE: the queries are zero-padded to whole tiles of Q_TILE rows: float32 matmuls of 1-3
    rows take another kernel than 4 or more (measured on the dev box: 3 query rows round
    differently from 6; any multiple of 4 from 4 to 400 rows gives the same bits). The keys
    are zero-padded (masked) to whole KV_BLOCKs.
    """
    kernels = KERNELS.get(q.device.type)
    if kernels is not None:
        return kernels.attend(q, keys, values, mask, scale, softcap, positions=positions, window=window, sinks=sinks)
    dtype = q.dtype
    b, h, m, d = q.shape
    n = aligned(keys.shape[2])
    if n != keys.shape[2]:  # masked keys: weight exactly 0
        keys, values = (F.pad(x, (0, 0, 0, n - x.shape[2])) for x in (keys, values))
        mask = F.pad(mask, (0, n - mask.shape[-1]), value=float("-inf"))
    nb, rows = n // KV_BLOCK, query_rows(m)
    if dtype != torch.float32:
        q, keys, values = q.float(), keys.float(), values.float()
    if rows != m:
        q = F.pad(q, (0, 0, 0, rows - m))
    if mask.dtype != torch.float32:
        mask = mask.float()
    if mask.shape[-2] not in (1, rows):  # the padded queries see every key (finite, dropped)
        mask = F.pad(mask, (0, 0, 0, rows - mask.shape[-2]))
    if softcap is None:  # scale, product and mask in one op: [B * Hkv, M, L]
        if mask.dim() == 4:
            mask = mask.expand(b, h, rows, n).reshape(b * h, rows, n)
        scores = torch.baddbmm(mask, q.view(b * h, rows, d), keys.reshape(b * h, n, d).transpose(-1, -2), alpha=scale).view(b, h, rows, n)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap).add_(mask)
    if sinks is not None:  # [B, Hkv, rows, 1] float32; the padded queries' 0 (finite, dropped)
        sinks = sinks.to(torch.float32)
        if sinks.dim() > 1 and sinks.shape[-2] not in (1, rows):
            sinks = F.pad(sinks, (0, 0, 0, rows - sinks.shape[-2]))
        sinks = sinks.expand(b, h, rows, 1)
    if scores.device.type == "cpu":
        # NOTE: PyTorch's CPU softmax sums a row in one sequential vector accumulation, so the
        # exact zeros of masked blocks past a query change nothing (measured: 0 of 175 rows
        # differ with 1-3 more masked blocks or more rows, 1 and 2 threads); the row's length
        # is a whole number of blocks, no scalar tail. A sink is one more block after the
        # keys (the sink, then -inf): added last, after those zeros, in every call.
        if sinks is None:
            probs = torch.softmax(scores, -1)
        else:
            tail = torch.full((b, h, rows, KV_BLOCK), float("-inf"), device=scores.device)
            tail[..., :1] = sinks
            probs = torch.softmax(torch.cat([scores, tail], -1), -1)[..., :n]
        sums = None
    else:  # a GPU softmax reduces by the row's length: max, exp and each block's own sum
        top = scores.amax(-1, keepdim=True)
        if sinks is not None:  # the max with the sink's (no weight overflows), its weight added last
            top = torch.maximum(top, sinks)
        probs = scores.sub_(top).exp_()
        sums = _in_order(probs.view(b, h, rows, nb, KV_BLOCK).sum(-1), 3)
        if sinks is not None:
            sums = sums + (sinks - top).exp_()[..., 0]
    if nb == 1:
        out = torch.matmul(probs, values)
    else:  # each block's P @ V over its KV_BLOCK keys, the blocks added in position order
        blocks = probs.view(b, h, rows, nb, KV_BLOCK).transpose(2, 3)
        out = _in_order(torch.matmul(blocks, values.view(b, h, nb, KV_BLOCK, d)), 2)
    if sums is not None:
        out = out / sums[..., None]
    return out[:, :, :m].to(dtype)


def _in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of `x` over `dim`, strictly first to last (trailing zeros then change nothing):
    `cumsum` on CPU (a sequential loop), one add per entry elsewhere (a GPU scan is a tree)."""
    if x.device.type == "cpu":
        return x.cumsum(dim).select(dim, -1)
    out = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        out = out + x.select(dim, i)
    return out


def query_rows(m: int) -> int:
    """The query rows `attend` computes for m queries (whole tiles of Q_TILE)."""
    return aligned(m, Q_TILE)


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` ([..., in] -> [..., out]) with each row's result independent of the other
    rows: the rows are zero-padded to whole tiles (ROW_TILE; CUDA_ROW_TILE on CUDA) and
    computed by F.linear, one call per tile; or, for a layer
    whose tiles `enable` found to round a row by its place in the tile, the device's Triton
    linear kernel (`kvserve_exact_kernel`).

    NOTE: measured on the dev box (AMD EPYC, AVX-512 + bf16; torch 2.13's MKL and oneDNN), fp32
    and bf16, 1 and 2 threads, SmolLM2's four weight shapes: MKL's sgemm (F.linear) gives 1
    row, 2-3 rows and 4+ rows three different roundings, while any multiple of 4 from 4 to
    1024 rows gives each row the same bits, at any place in the call; oneDNN's packed matmul
    differs only between 1 row and 2+ (cpu_linear computes 1-3 rows as 4); bf16 never varied.
    On an Intel Xeon with AVX-512 (Sapphire Rapids' flags; the CI box) MKL's sgemm rounded a
    row among 16 rows otherwise than the same row among 8, so one call over whole tiles is not
    enough on every CPU. MKL, like cuBLAS (kernel and split-K), picks its kernel by shape:
    every call is exactly one tile (ROW_TILE rows, CUDA_ROW_TILE on CUDA), so all run one.
    """
    if getattr(layer, "kvserve_exact_kernel", False):
        return KERNELS[x.device.type].linear(x, layer.weight, layer.bias)
    return product(x, layer.weight, layer.bias)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's result independent of the other rows: one
    F.linear call per whole tile of rows (`linear`'s NOTE)."""
    tile = ROW_TILE if x.device.type == "cpu" else CUDA_ROW_TILE
    return by_tiles(lambda rows: F.linear(rows, weight, bias), x, tile, one_call=False)


def norm(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A normalization layer's `forward(x)` (RMSNorm, LayerNorm: over the last dimension)
    with each row's result independent of the other rows: off CPU one call per tile of
    `norm_tile(dim)` rows (zero-padded), on CPU as it is.

    NOTE: PyTorch's CUDA reduction (the mean of squares) picks its thread layout by the
    number of rows as well as the row's length (ATen's Reduce.cuh, `setReduceConfig`: the
    block height follows the row count, and with it whether a row's sum is split between
    warps, or between thread blocks when the rows are few and long), so a row's norm could
    round by how many rows its step has. A fixed shape is one layout. Read in the source, not
    yet measured on a GPU. The CPU's norms measured the same bits among 1-512 rows
    (docs/architecture.md), so they run as they are."""
    if x.device.type == "cpu":
        return forward(x)
    return by_tiles(forward, x, norm_tile(x.shape[-1]), one_call=False)


def norm_tile(dim: int) -> int:
    """Rows per call of a norm over `dim` features off CPU: CUDA_ROW_TILE, or more for short
    rows (a per-head norm over head_dim), about NORM_TILE_ELEMENTS values a call."""
    return max(CUDA_ROW_TILE, NORM_TILE_ELEMENTS // dim)


def by_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, one_call: bool) -> torch.Tensor:
    """fn over x's rows ([..., in] -> [..., out]) zero-padded to whole tiles of `tile` rows:
    in one call (`one_call`, or a single tile), otherwise one call per tile."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = aligned(n, tile)
    if padded != n:
        rows = F.pad(rows, (0, 0, 0, padded - n))
    out = fn(rows) if one_call or padded == tile else torch.cat([fn(t) for t in rows.split(tile)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def enable(model) -> None:
    """In an exact step (`StepContext.exact`, server/engine/context.py): route the linear
    layers of `model` that run through PyTorch's own `F.linear` (every one off CPU; on CPU
    server/engine/cpu_linear.py's forwards ask `context.exact()` themselves) through `linear`, and its normalization layers (nn.LayerNorm,
    transformers' *RMSNorm classes) through `norm`. Off CPU, a layer whose shape fails
    `tiles_invariant` is computed by the Triton linear kernel (and without it, exact mode
    refuses to start). Idempotent."""
    for module in model.modules():
        if "forward" in vars(module):
            continue
        if type(module) is torch.nn.Linear:
            module.kvserve_exact_kernel = _needs_kernel(module)
            module.forward = _switched.__get__(module)
        elif isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
            module.forward = functools.partial(_switched_norm, module.forward)


_verdicts: dict[tuple, bool] = {}  # (device, dtype, out, in, bias) -> whether its tiles are invariant


def _needs_kernel(layer: torch.nn.Linear) -> bool:
    """Whether `linear` must compute `layer` with the Triton kernel: off CPU, when one tile's
    call rounds a row by its place (`tiles_invariant`, once per shape and device)."""
    w = layer.weight
    if w.device.type == "cpu":
        return False
    key = (str(w.device), w.dtype, *w.shape, layer.bias is not None)
    if key not in _verdicts:
        _verdicts[key] = tiles_invariant(w, layer.bias)
        if not _verdicts[key]:
            log.warning("exact mode: %s linear layers %s on %s round a row by its place in a tile; computed by the Triton kernel", w.dtype, tuple(w.shape), w.device)
    if _verdicts[key]:
        return False
    if w.device.type not in KERNELS or type(w) not in (torch.Tensor, torch.nn.Parameter):  # no kernel, or a quantized weight
        raise RuntimeError(f"exact mode cannot run on {w.device}: its {w.dtype} linear layers {tuple(w.shape)} round a row by its place "
                           "in a tile, and the Triton linear kernel cannot replace them (unusable: see the warning above; or a quantized weight)")
    return True


def tiles_invariant(weight: torch.Tensor, bias: torch.Tensor | None, product: Callable = F.linear) -> bool:
    """Whether `product` (F.linear) over one tile of CUDA_ROW_TILE rows, `linear`'s call off
    CPU, gives a row the same bits at any place in the tile and beside any other rows: a row
    among random ones against a tile of copies of it (every place at once), for four rows.

    NOTE: one shape is one kernel, but a kernel that splits the tile's rows between thread
    blocks may still split the reduction differently for each (cuBLAS's stream-K on Hopper
    balances the work by tiles), so a decoded row (place 0) could round differently from the
    same row in a prefill chunk (any place). A matmul's arithmetic never depends on the
    values, so random rows settle it for the shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(CUDA_ROW_TILE, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    mixed = product(x, weight, bias)
    for i in (0, 1, CUDA_ROW_TILE // 2 + 3, CUDA_ROW_TILE - 1):
        copies = product(x[i : i + 1].expand(CUDA_ROW_TILE, -1).contiguous(), weight, bias)
        if not torch.equal(copies, mixed[i].expand_as(copies)):
            return False
    return True


def _switched(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(layer, x) if context.exact() else F.linear(x, layer.weight, layer.bias)


def _switched_norm(forward: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs or not context.exact():  # a norm of another signature: as it is
        return forward(x, *args, **kwargs)
    return norm(forward, x)


KERNELS: dict[str, ModuleType] = {}  # device type -> exact_kernel there (`attend`, `linear`; `pin_backends` sets CUDA's)


@functools.cache
def pin_backends(device: torch.device, dtype: torch.dtype) -> str:
    """Settings exact mode needs on `device` and its Triton kernels there (`use_kernel`), set
    once per process and device: the composition root asks first (for the numerics that name
    session files), a model runner in exact mode makes sure of it (the cached answer). Returns what else the
    mode's bits depend on (a session file's and `system_fingerprint`'s numerics): the
    platform, whose libraries round the same products differently (the GPU and the CUDA
    version; the CPU's vector extensions), the torch version, and on CUDA the attention:
    "triton" or "torch" (its fallback).

    NOTE (CUDA): cuBLAS may split a bf16/fp16 GEMM's reduction and round partial sums to the
    half type when allowed to (`allow_*_reduced_precision_reduction`), and TF32 changes fp32
    products; a fixed workspace (CUBLAS_WORKSPACE_CONFIG) keeps cuBLAS from choosing a
    different algorithm as its workspace varies. None of this makes cuBLAS batch-invariant by
    itself (that is `linear`'s fixed row tiles, checked per shape by `enable`, and the
    attention kernel); it removes the other sources.
    Not applied in the default mode, whose speed they would cost."""
    if device.type != "cuda":
        return f"{device.type} {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    attention = "triton" if use_kernel(device, dtype) else "torch"
    return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {torch.__version__}, {attention}"


def use_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Make server/engine/exact_kernel.py's kernels `attend`'s and (where `enable` finds cuBLAS's
    tiles unfit) `linear`'s on `device` (run by Triton's interpreter off a GPU, when
    TRITON_INTERPRET=1), once they compile and agree with the torch formulation and F.linear
    on small random calls in `dtype` (attention with sinks and without: their programs
    differ); otherwise keep the torch ones, with a warning. The attention's two ways of
    walking chunks must give the same bits, or only one is used (`exact_kernel.spread`).
    Chosen once per process, before the first forward pass, so every query of a process is
    computed alike. True when the kernels are in use."""
    if device.type in KERNELS:
        return True
    try:
        from server.engine import exact_kernel

        gen = torch.Generator().manual_seed(0)
        n = exact_kernel.CHUNK + 300  # two chunks
        q, keys, values = (torch.randn(2, 2, m, 64, generator=gen).to(device, dtype) for m in (24, n, n))
        allowed = torch.arange(n)[None, :] <= torch.arange(n - 40, n - 16)[:, None]
        mask = torch.zeros(2, 1, 24, n).masked_fill(~allowed, float("-inf")).to(device, dtype)
        sinks = torch.randn(1, 2, 24, 1, generator=gen).to(device)
        spread, walked = [], []
        for s in (None, sinks):
            spread.append(exact_kernel.attend(q, keys, values, mask, 0.125, None, parallel=True, sinks=s))
            walked.append(exact_kernel.attend(q, keys, values, mask, 0.125, None, parallel=False, sinks=s))
            _agrees("attention", walked[-1], attend(q, keys, values, mask, 0.125, None, sinks=s))
        for outputs in (200, 8200):  # both column tiles (`linear_block_n`), with a bias and without
            x, w, b = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((70, 100), (outputs, 100), (outputs,)))
            _agrees("linear", exact_kernel.linear(x, w, b), F.linear(x, w, b))
            _agrees("linear", exact_kernel.linear(x, w, None), F.linear(x, w))
    except Exception as e:  # noqa: BLE001 - any failure (no Triton, no compiler, a wrong result) keeps the torch path
        log.warning("exact mode: the Triton kernels are unusable on %s (%s); using the torch formulation and cuBLAS", device, e)
        return False
    if not all(map(torch.equal, spread, walked)):  # then every launch walks its chunks in one program
        log.warning("exact mode: the attention kernel's chunks spread over programs round differently from one walk; walking only")
        exact_kernel.spread = False
    KERNELS[device.type] = exact_kernel
    log.info("exact mode: attention by the Triton kernel on %s", device)
    return True


def _agrees(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-5 if got.dtype == torch.float32 else 2e-2
    if not torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance):
        raise ValueError(f"its {what} differs from torch's by up to {(got.float() - want.float()).abs().max().item():.3g}")
