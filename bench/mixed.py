"""Steps of more than decode rows (issue 47): the compiled forward against the eager one, in
milliseconds per step on the model of bench/kernels.py (Qwen2.5-1.5B's 28 layers at small
widths, bf16), where a step's time is mostly the host's dispatch of its kernels, as in an eager
step on a GPU.

    .venv/bin/python -m bench.mixed [--layers 28] [--rows 8] [--reps 30]

Both runners take the paged path (a GPU's) over one pool; the compiled one as a GPU serves
(`--compile`: its steps of more than decode rows run the compiled forward, each layer's batches
in the one opaque op `kvserve::step_attention`). R rows hold a prompt of bench/kernels.py's
PROMPT tokens; each timed step is then one of:

* prefill beside decode: the R rows' next tokens and a new row's CHUNK-token prompt;
* forced tokens: the R rows' next tokens, two of them with two more each (as a grammar forces
  them);
* decode: the R rows' next tokens alone (the decode steps' own compiled graph; on a GPU it is
  replayed from a CUDA graph, which this does not measure).

Each step is timed REPS times, the caches cut back after each; the median is printed with the
greedy tokens of both ways compared. The compilations are not timed (`prepare` does them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import kernels
from cache_manager import kv
from server.engine.context import Row
from server.engine.model_runner import ModelRunner

CHUNK = 16


def steps(rows: int, vocab: int) -> dict[str, tuple[list[list[int]], int]]:
    """Each kind of step's tokens per row, and how many of its rows hold a prompt (the others,
    last, are new prompts)."""
    decode = [[(7 * r + 11) % (vocab - 3) + 3] for r in range(rows)]
    forced = [t + [5, 6] if r < 2 else t for r, t in enumerate(decode)]
    prompt = [(3 * t + 1) % (vocab - 3) + 3 for t in range(CHUNK)]
    return {"prefill beside decode": (decode + [prompt], rows), "forced tokens": (forced, rows), "decode": (decode, rows)}


def timed(runner: ModelRunner, tokens: list[list[int]], prompted: int, reps: int) -> tuple[float, list[int]]:
    """The median seconds of one step of `tokens` (after a prompt in each of the first
    `prompted` rows) and its greedy tokens."""
    pool, vocab = runner.pool, runner.model.config.vocab_size
    caches = [pool.allocate(kernels.PROMPT + CHUNK) for _ in tokens]
    try:
        prompts = [t for r in range(prompted) for t in kernels._prompt(r, vocab)]
        runner.forward([Row(c, kernels.PROMPT) for c in caches[:prompted]], prompts, list(range(prompted)))
        times, chosen = [], []
        for _ in range(reps):
            start = time.perf_counter()
            logits = runner.forward([Row(c, len(t)) for c, t in zip(caches, tokens)], sum(tokens, []), list(range(len(tokens))))
            chosen = logits.argmax(-1).tolist()
            times.append(time.perf_counter() - start)
            for i, cache in enumerate(caches):
                kv.crop(cache, kernels.PROMPT if i < prompted else 0)
        return statistics.median(times), chosen
    finally:
        for cache in caches:
            kv.free(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=kernels.LAYERS)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one: no thread pool's waits in the count)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = kernels.build(args.layers)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, kernels.PROMPT + CHUNK, model.dtype) * (args.rows + 1), model.device, model.dtype)
    eager = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None, max_rows=args.rows + 1, merge=True)
    fast = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None, max_rows=args.rows + 1, merge=True, compile="require")
    start = time.perf_counter()
    fast.prepare()
    if fast.paths["compile"] != "decode+mixed":
        raise SystemExit(f"not compiled: {fast.fallbacks.get('compile')}")
    print(f"{args.layers} layers, {args.rows} rows, bf16, CPU threads {torch.get_num_threads()}; "
          f"compiled in {time.perf_counter() - start:.0f} s (three graphs)")
    print("| step | eager ms | compiled ms | compiled / eager | same tokens |")
    print("|---|---:|---:|---:|---|")
    for name, (tokens, prompted) in steps(args.rows, model.config.vocab_size).items():
        (slow, want), (quick, got) = (timed(runner, tokens, prompted, args.reps) for runner in (eager, fast))
        print(f"| {name} | {slow * 1e3:.1f} | {quick * 1e3:.1f} | {quick / slow:.2f} | {got == want} |")


if __name__ == "__main__":
    main()
