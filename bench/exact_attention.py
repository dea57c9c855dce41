"""Exact mode's paged attention against the default mode's, call for call, on the shapes the
paged path hands them: the Triton kernel (server/engine/exact_kernel.py; CUDA, or Triton's
interpreter with --interpret, for a look only) and the torch formulation (`exact.attend`'s
fallback), each as a ratio to plain `scaled_dot_product_attention` with the same additive mask
(the default mode's `_attend`), measured in one run.

    .venv/bin/python -m bench.exact_attention --device cuda [--dtype bfloat16] [--repeats 20]

Shapes: Qwen2.5-1.5B (2 KV heads of 6 query heads) and Qwen2.5-32B (8 KV heads of 5), head size
128: decode steps of 1, 8 and 64 rows at 1k, 8k and 32k tokens of context, and a prefill chunk
of 512 tokens at 4k. Every row reads the longest row's keys, as a bucketed step does.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

MODELS = {"qwen1.5b": (2, 6), "qwen32b": (8, 5)}  # KV heads, query heads per KV head
DIM = 128


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of one call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def case(rows: int, width: int, context: int, kv_heads: int, groups: int, device, dtype):
    """(q, keys, values, mask) as the paged path builds them: rows' last `width` tokens end at
    `context`, the keys of every row read to `context`."""
    q = torch.randn(rows, kv_heads, groups * width, DIM, device=device, dtype=dtype)
    keys, values = (torch.randn(rows, kv_heads, context, DIM, device=device, dtype=dtype) for _ in range(2))
    positions = torch.arange(context - width, context, device=device)
    allowed = torch.arange(context, device=device)[None, :] <= positions[:, None]
    mask = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf")).to(dtype)
    mask = (mask.repeat(groups, 1) if width > 1 else mask)[None, None].expand(rows, 1, -1, -1)
    return q, keys, values, mask


def kernel_options(doc: str) -> argparse.ArgumentParser:
    """The options of both kernel benchmarks (this and bench/exact_linear.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="run the kernel in Triton's interpreter (CPU; slow, small shapes only)")
    return parser


def main() -> None:
    parser = kernel_options(__doc__)
    parser.add_argument("--contexts", default="1024,8192,32768", help="decode steps' context lengths")
    parser.add_argument("--prefill-context", type=int, default=4096, help="where the 512-token prefill chunk ends")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from server.engine import exact

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kernel = None
    if device.type == "cuda" or args.interpret:
        from server.engine import exact_kernel

        kernel = exact_kernel.attend
    fallback = exact.KERNELS.pop(device.type, None)  # `exact.attend` below: the torch formulation
    print(f"device {device}, {args.dtype}, median of {args.repeats} calls; ratios to SDPA with the same mask")
    print("\n| model | step | context | SDPA ms | kernel ms | **kernel / SDPA** | torch formulation ms | **torch / SDPA** |\n|---|---|---|---|---|---|---|---|")
    contexts = [int(c) for c in args.contexts.split(",")]
    steps = [(rows, 1) for rows in (1, 8, 64)] + [(1, 512)]
    for name, (kv_heads, groups) in MODELS.items():
        for rows, width in steps:
            for context in contexts if width == 1 else [args.prefill_context]:
                q, keys, values, mask = case(rows, width, context, kv_heads, groups, device, dtype)
                positions = torch.arange(context - width, context, device=device).expand(rows, width)  # as the paged path hands them
                scale = DIM**-0.5
                base = timed(lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale), args.repeats, device)
                cells = [f"{1000 * base:.3f}"]
                for fn in (kernel, exact.attend):
                    if fn is None:
                        cells += ["-", "-"]
                        continue
                    seconds = timed(lambda: fn(q, keys, values, mask, scale, None, positions=positions), args.repeats, device)
                    cells += [f"{1000 * seconds:.3f}", f"**{seconds / base:.2f}x**"]
                step = f"decode x{rows}" if width == 1 else f"prefill {width}"
                print(f"| {name} | {step} | {context} | " + " | ".join(cells) + " |")
    if fallback is not None:
        exact.KERNELS[device.type] = fallback


if __name__ == "__main__":
    main()
