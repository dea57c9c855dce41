"""The compiled decode forward on CPU (issue 47, server/engine/compiled.py): decode steps through
the model runner with the forward compiled by inductor against the eager ones CPU serves by
default (the row path), on the same weights in one run, with the compile time cold and warm.

    .venv/bin/python -m bench.compiled [--rows 1 8] [--steps 32] [--dtypes float32 bfloat16] [--linear packed dense]

The model: the embedded SmolLM2-135M (or --model). R rows each prefill PROMPT tokens, then STEPS
decode steps of all R run, each row's argmax fed back; tok/s = R * STEPS / their time. Cold: the
first compilation into an empty inductor cache; warm: the same again after `torch._dynamo.reset()`,
from the on-disk cache (what a restart costs); the forward is compiled dynamic in rows, so the cold
compilation is measured once per dtype and linear path (at the first --rows). Greedy tokens:
whether both sides chose the same.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from cache_manager import kv
from server.engine import compiled
from server.engine.context import Row
from server.engine.model_runner import ModelRunner
from server.model_loader import load_model
from server.settings import default_cache_dir

PROMPT = 32


def decode_rate(runner: ModelRunner, rows: int, steps: int) -> tuple[float, list[list[int]]]:
    """Tokens per second of `steps` decode steps of `rows` rows, and the tokens chosen."""
    vocab = runner.model.config.vocab_size
    caches = [runner.pool.allocate(PROMPT + steps + 1) for _ in range(rows)]
    try:
        prompts = [[(r * 997 + t * 31 + 11) % vocab for t in range(PROMPT)] for r in range(rows)]
        ids = runner.forward([Row(c, PROMPT) for c in caches], sum(prompts, []), list(range(rows))).argmax(-1).tolist()
        chosen = []
        start = time.perf_counter()
        for _ in range(steps):
            ids = runner.forward([Row(c, 1) for c in caches], ids, list(range(rows))).argmax(-1).tolist()
            chosen.append(ids)
        return rows * steps / (time.perf_counter() - start), chosen
    finally:
        for cache in caches:
            kv.free(cache)


def runner_for(loaded, rows: int, packed: bool, compile: str) -> tuple[ModelRunner, float]:
    """A prepared runner, and the seconds `prepare` took (the compilation, when on)."""
    pool = kv.Pool(loaded.model.config, kv.bytes_for(loaded.model.config, PROMPT + 256, loaded.dtype) * rows, loaded.device, loaded.dtype)
    runner = ModelRunner(loaded.model, pool, cuda_graphs=False, packed=packed, max_rows=rows, merge=True, compile=compile)
    start = time.perf_counter()
    runner.prepare()
    if compile == "require" and runner.paths["compile"] == "eager":
        raise SystemExit(f"not compiled: {runner.fallbacks.get('compile')}")
    return runner, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--linear", nargs="+", default=["packed", "dense"], choices=["packed", "dense"])
    args = parser.parse_args()
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.steps} decode steps after {PROMPT}-token prompts\n")
    print("| dtype | linear | rows | eager tok/s | compiled tok/s | compiled / eager | same tokens | compile cold s | warm s |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    for dtype in args.dtypes:
        for linear in args.linear:
            loaded = load_model(args.model, cache_dir=default_cache_dir(), device="cpu", dtype=dtype)
            packed = linear == "packed"
            for i, rows in enumerate(args.rows):
                eager, _ = runner_for(loaded, rows, packed, "off")
                base, want = decode_rate(eager, rows, args.steps)
                torch._dynamo.reset()
                cold = "-"  # the compiled forward is dynamic in rows: one cold compilation per dtype and linear
                if i == 0:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvserve-inductor-")  # empty: cold
                    cold = f"{runner_for(loaded, rows, packed, 'require')[1]:.0f}"
                    torch._dynamo.reset()
                fast, warm = runner_for(loaded, rows, packed, "require")
                rate, got = decode_rate(fast, rows, args.steps)
                print(f"| {dtype} | {linear} | {rows} | {base:.1f} | {rate:.1f} | {rate / base:.2f}x | {got == want} | {cold} | {warm:.0f} |",
                      flush=True)
    print(f"\ncompilations in this process: {compiled.compilations()}, graph breaks: {compiled.graph_breaks()}")


if __name__ == "__main__":
    main()
