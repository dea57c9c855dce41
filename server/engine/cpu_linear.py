"""On CPU, linear layers on weights packed for oneDNN's matmul, or the transposed product:
MKL's gemv and small-m sgemm run far below the machine's peak at the few rows of a decode step
(docs/architecture.md, "The engine step"). Only `pack_model` is called from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.engine import context, exact


def pack_model(model, packed: bool = True) -> tuple[int, int]:
    """On CPU, run every `nn.Linear` of `model` on a packed weight (`_pack`), or on the
    transposed product (`_cpu_linear`) where this build cannot pack or `packed` is False (the
    dense weights only: half the memory of the linear layers, slower). Nothing on other
    devices, nothing for layers already switched, nothing for quantized layers (`dense`).

    NOTE: call it on the thread that will run the model (the server's engine thread): packing
    runs multi-threaded, and a second thread that runs multi-threaded torch ops slows every
    step down (docs/architecture.md, "One OpenMP team").

    Returns how many layers it switched: (on a packed weight, on the transposed product)."""
    if model.device.type != "cpu":
        return 0, 0
    counts = [0, 0]
    for module in model.modules():
        if dense(module) and "forward" not in vars(module):
            if packed and _pack(module):
                counts[0] += 1
            else:
                module.forward = _cpu_linear.__get__(module)
                counts[1] += 1
    return counts[0], counts[1]


def dense(module) -> bool:
    """A plain `nn.Linear` over a plain floating-point weight. Quantized layers are left alone:
    bitsandbytes, compressed-tensors and GPTQ/AWQ layers are classes of their own, torchao keeps
    `nn.Linear` around a quantized tensor subclass; each runs its own kernels."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and weight is not None
        # NOTE: a Parameter around a tensor subclass is an instance of the subclass itself
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dtype.is_floating_point
    )


PACKED_FOR_ROWS = 16  # the row count oneDNN lays a packed weight out for (any count runs on it)


def _pack(layer: torch.nn.Linear) -> bool:
    """On CPU, run `layer` on a copy of its weight packed for oneDNN's matmul (False: this
    build or dtype cannot).

    PyTorch's own `F.linear` (MKL sgemm) runs far below the machine's peak at the few rows of
    a decode step and at the 9-64 of a speculative verification, where a packed weight keeps
    oneDNN near it (the figures: docs/benchmarks.md, "The CPU path"). The price is memory: the linear weights are held
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
    """`layer(x)` through its packed weight (`_pack`); in exact mode one call per whole tile of
    `exact.ROW_TILE` rows (zero-padded), as `exact.linear` computes the other layers.

    NOTE: measured: on an AMD EPYC (AVX-512 + bf16) oneDNN rounded 1 row apart from 2+ and any
    2+ alike; on an Intel Xeon with AMX (the dev box since 2026-11-29) a bf16 row of SmolLM2's
    1536-wide projections rounds alike among 1-32 rows and otherwise among 64 or more (oneDNN
    takes another kernel), which broke exact mode's bf16 chunks. One shape per call is one
    kernel on any CPU."""
    if context.exact():
        return exact.by_tiles(lambda rows: _packed_product(layer, rows), x, exact.ROW_TILE, one_call=False)
    return _packed_product(layer, x)


def _packed_product(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inductor lowers oneDNN's op for weights it packed itself only
        return packed_linear(x, layer.kvserve_packed, layer.bias, layer.out_features)
    return torch.ops.mkldnn._linear_pointwise(x, layer.kvserve_packed, layer.bias, "none", [], "")


@torch.library.custom_op("kvserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] through a weight packed for oneDNN (`_pack`) -> [..., out_features]: opaque
    to a compiled forward (server/engine/compiled.py), which calls it as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


ROW_BLOCK = 8  # on CPU, linear layers over 9-32 positions run on a multiple of this many
MAX_TRANSPOSED = 32  # ... and over more positions (prefill chunks) through F.linear


def _cpu_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` ([..., in] -> [..., out]) on CPU where `_pack` cannot, fast for the few
    positions of a decode step (one per sequence, plus drafted tokens).

    For 1-32 rows, MKL's gemv (one row) and its sgemm against a (out x in) weight run far below
    the transposed product weight @ x.T, and that product itself slows down at row counts that
    are not a multiple of 8 (the figures: docs/benchmarks.md, "The CPU path"). So one row is
    computed as two (itself twice), 2-8 rows as they are, 9-32 rows padded (with copies of the
    first) to a multiple of ROW_BLOCK: a speculative verification of 9-16 positions costs what
    16 do. Prefill chunks keep `F.linear`, which wins there. Padding never
    changes the real rows' results beyond rounding (the near-ties of docs/architecture.md).
    """
    if context.exact():  # the padding below changes a row's bits with the row count
        return exact.linear(layer, x)
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


