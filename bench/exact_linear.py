"""Exact mode's linear layers against the default mode's, call for call, on real layer shapes:
its fixed row tiles through cuBLAS (`exact.linear`, one call per CUDA_ROW_TILE rows) and the
Triton linear kernel (server/engine/exact_kernel.py, which `exact.enable` uses for a shape
whose tiles fail `exact.tiles_invariant`), each as a ratio to plain `F.linear` (the default
mode's) measured in one run; and whether each shape's tiles pass the check on this device.

    .venv/bin/python -m bench.exact_linear --device cuda [--dtype bfloat16] [--repeats 20]

Shapes (out x in): Qwen2.5-1.5B's and Qwen2.5-32B's attention projections, MLP and LM head, at
decode steps of 1, 8 and 64 rows and prefill chunks of 512 and 2048 rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from bench.exact_attention import kernel_options, timed

SHAPES = {  # layer -> (out, in)
    "qwen1.5b": {"q/o": (1536, 1536), "k/v": (256, 1536), "gate/up": (8960, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)},
    "qwen32b": {"q/o": (5120, 5120), "k/v": (1024, 5120), "gate/up": (27648, 5120), "down": (5120, 27648), "lm_head": (152064, 5120)},
}
ROWS = (1, 8, 64, 512, 2048)


def main() -> None:
    parser = kernel_options(__doc__)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--models", default=",".join(SHAPES))
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from server.engine import exact

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    exact.pin_backends(device, dtype)  # the settings exact mode runs with (CUDA)
    kernel = None
    if device.type == "cuda" or args.interpret:
        from server.engine import exact_kernel

        kernel = exact_kernel.linear
    print(f"device {device}, {args.dtype}, median of {args.repeats} calls; ratios to F.linear")
    print("\n| model | layer | out x in | tiles invariant | rows | F.linear ms | tiles ms | **tiles / F.linear** | kernel ms | **kernel / F.linear** |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for layer_name, (out, inputs) in SHAPES[name].items():
            layer = torch.nn.Linear(inputs, out, bias=layer_name in ("q/o", "k/v"), device=device, dtype=dtype)
            invariant = exact.tiles_invariant(layer.weight, layer.bias)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, inputs, device=device, dtype=dtype)
                base = timed(lambda: F.linear(x, layer.weight, layer.bias), args.repeats, device)
                cells = [f"{1000 * base:.3f}"]
                for fn in (lambda: exact.linear(layer, x), None if kernel is None else lambda: kernel(x, layer.weight, layer.bias)):
                    if fn is None:
                        cells += ["-", "-"]
                        continue
                    seconds = timed(fn, args.repeats, device)
                    cells += [f"{1000 * seconds:.3f}", f"**{seconds / base:.2f}x**"]
                print(f"| {name} | {layer_name} | {out} x {inputs} | {'yes' if invariant else '**no**'} | {rows} | " + " | ".join(cells) + " |")
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
