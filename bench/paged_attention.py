"""One layer's attention on the paged path (issue 47): the paged attention kernel against the
gathered way it replaces, in the same run, for decode rows and for rows of several tokens
(drafted or forced tokens, prefill chunks) over contexts the rows already hold.

    .venv/bin/python -m bench.paged_attention [--shape qwen1.5b] [--rows 1 8 64] [--widths 1 4 64]
                                              [--contexts 512 4096] [--kv-dtype auto] [--reps 50] [--device cuda]

Each case is B rows holding `context` tokens each, T new tokens a row: the layer's store of
their keys and values and their attention, as `attention._attend_batch` runs it for one
`Batch` (the decode rows' one op, or a multi-token batch). Gathered: the gather index and the
masks of `Batch.prepare` (built once a step, timed with the layer: a step of L layers pays them
once, so the figure overstates them L-fold at most) and the whole bucket gathered and attended
under the mask; kernel: the pool read in place (server/engine/paged_kernel.py). Printed: the
median microseconds of each and the kernel's over the gathered, with the largest difference of
their outputs (same keys, same queries; float32 rounding in bf16 apart). `--kv-dtype fp8` (or
int8): the pool holds codes and scales, which the gathered way dequantizes for the whole bucket
and the kernel reads in place.

On a GPU the figures are the kernel's point; on CPU the op runs its reference (or Triton's
interpreter), so the times say nothing and the run is a check that the two agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

from cache_manager import kv
from server.engine import attention
from server.engine.context import Batch
from server.engine.model_runner import paged_inputs

# name: (query heads, KV heads, head width) of a model's attention
SHAPES = {"qwen1.5b": (12, 2, 128), "qwen7b": (28, 4, 128), "qwen32b": (40, 8, 128), "tiny": (4, 2, 16)}


def config_for(shape: str):
    heads, kv_heads, dim = SHAPES[shape]
    return AutoConfig.for_model("qwen2", num_hidden_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, intermediate_size=64, vocab_size=64)


def case(config, rows: int, width: int, context: int, device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto", seed: int = 0):
    """A pool (in `kv_dtype`) whose B rows hold `context` random keys and values each, and the
    step's new tokens: (pool, caches, a batch builder by `kernel`, query [H, N, D], key and
    value [Hkv, N, D])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = kv.Pool(config, kv.bytes_for(config, context + width, dtype, kv_dtype) * rows, device, dtype, kv_dtype=kv_dtype)
    every = slice(0, pool.keys[0].shape[1])
    pool.store(0, every, *(torch.randn(x.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
                            for x in (pool.keys[0], pool.values[0])))
    caches = [pool.allocate(context + width) for _ in range(rows)]
    for cache in caches:
        cache.length = context  # held: the random keys and values stored above
    blocks = kv.blocks_for(context + width, pool.block_size)
    positions, slots, tables = paged_inputs(pool, caches, [width] * rows, rows, width, blocks)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731

    def batch(kernel: bool) -> Batch:
        tokens = None if width == 1 else torch.arange(rows * width, device=device)
        return Batch(pool, as_tensor(slots), as_tensor(tables).view(rows, blocks), as_tensor(positions), width, tokens, kernel=kernel)

    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    n = rows * width
    query = torch.randn(heads, n, dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
    key, value = (torch.randn(kv_heads, n, dim, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(2))
    return pool, caches, batch, query, key, value


def layer(pool, batch: Batch, query, key, value) -> torch.Tensor:
    """One layer's store and attention of `batch`, its masks and gather index included."""
    groups = query.shape[0] // key.shape[0]
    batch.prepare(pool.dtype, groups)
    return attention._attend_batch(batch, 0, query, key, value, groups, query.shape[-1] ** -0.5, None, None, attention._attend)


def timed(run, device: torch.device, reps: int) -> float:
    """The median seconds of `run()`, the device synchronised around each."""
    times = []
    for i in range(reps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:  # warm-up: the kernels' compilation, the allocator
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure(shape: str, rows: int, width: int, context: int, device: torch.device, dtype: torch.dtype, reps: int,
            kv_dtype: str = "auto") -> dict:
    config = config_for(shape)
    pool, caches, batch, query, key, value = case(config, rows, width, context, device, dtype, kv_dtype)
    try:
        gathered, through = batch(False), batch(True)
        out = {name: layer(pool, b, query, key, value) for name, b in (("gathered", gathered), ("kernel", through))}
        diff = float((out["kernel"].float() - out["gathered"].float()).abs().max())
        seconds = {name: timed(lambda b=b: layer(pool, b, query, key, value), device, reps)
                   for name, b in (("gathered", gathered), ("kernel", through))}
    finally:
        for cache in caches:
            kv.free(cache)
        pool.release()
    return {"shape": shape, "rows": rows, "width": width, "context": context, "gathered_us": seconds["gathered"] * 1e6,
            "kernel_us": seconds["kernel"] * 1e6, "ratio": seconds["kernel"] / seconds["gathered"], "max_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--kv-dtype", choices=sorted(kv.KV_DTYPES), default="auto")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (times meaningless: the kernel runs its reference or Triton's interpreter)"
    print(f"{args.shape} {SHAPES[args.shape]} (query heads, KV heads, width), {args.dtype}, KV {args.kv_dtype}, {name}")
    print("| rows | tokens a row | context | gathered µs | kernel µs | kernel / gathered | max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        for width in args.widths:
            for rows in args.rows:
                r = measure(args.shape, rows, width, context, device, dtype, args.reps, args.kv_dtype)
                print(f"| {rows} | {width} | {context} | {r['gathered_us']:.0f} | {r['kernel_us']:.0f} | {r['ratio']:.2f} | {r['max_diff']:.1e} |")


if __name__ == "__main__":
    main()
