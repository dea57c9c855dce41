"""Tensor parallel (server/parallel.py): what running one model over several ranks costs or
gives against one process, and what each rank's KV pool holds.

    .venv/bin/python -m bench.tp [--tokens 64] [--repeats 3] [--readme docs/benchmarks.md]
    .venv/bin/python -m bench.tp --device cuda --model DIR [--sizes 1,2,4,8] [--streams 1,64]

On CPU (the default) it is a correctness-and-overhead figure, not a speed claim: the ranks (2,
over gloo) share the cores one process would use (each rank 1 thread, the one process 2), so
the ratio says what the step's broadcast (server/engine/lockstep.py) and the forward's
all-reduces and gathers cost, nothing about what more GPUs buy. The model (fp32, seeded random
weights, saved to a temporary directory with SmolLM2's tokenizer): Llama-shaped, hidden 512, 8
layers, 8 query heads over 4 KV heads of 64, MLP 1536, vocabulary 49152; `--kv-budget-bytes`
256 MiB per rank.

On GPUs (`--device cuda` and a checkpoint in --model: a 70B one at 2, 4 and 8 ranks is the figure
the manual wants; no machine with several GPUs has been lent to this project yet, so it is
unmeasured) each size in --sizes gets a server of its own on GPUs 0..N-1, bf16, one after the
other, and a column compares one stream's tokens/s with one GPU's floor for the model: its
weights' bytes read once per step at one GPU's measured copy bandwidth (N GPUs: ideally N
times it).

Each round streams, for each stream count in --streams, that many 32-token prompts' --tokens
greedy tokens (end of turn biased away) at once, on each server in turn. Rate = the tokens
after each stream's first / the time from the first to the last (prefill left out); medians of
--repeats rounds, ratios against the smallest size. The greedy texts of every size are compared:
on CPU they must be equal (the run fails otherwise); in bf16 on GPUs another reduction order may
change a near-tie, so there the comparison is printed.

`--readme FILE` writes the tables into FILE between `<!-- bench.tp: begin -->` and
`<!-- bench.tp: end -->`. About 3 minutes on the 2-core dev box.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.architectures import tokenizer
from bench.common import launch, write_readme_block

README_BEGIN, README_END = "<!-- bench.tp: begin -->", "<!-- bench.tp: end -->"
BUDGET = 256 * 2**20  # per rank
STREAMS = 8


def build(path: Path) -> None:
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer().save_pretrained(path)


def stream(url: str, prompt: list[int], tokens: int) -> tuple[str, float, int]:
    """(text, seconds from the first token to the last, tokens after the first)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "logit_bias": {"2": -100}}
    text, first, last, n = "", None, None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"] if chunk["choices"] else ""
            if piece:
                now = time.perf_counter()
                first = first or now
                last, n = now, n + 1
                text += piece
    return text, (last - first), n - 1


def rate(url: str, prompts: list[list[int]], tokens: int) -> tuple[float, list[str]]:
    """Aggregate decode tokens/s of `prompts` streamed at once, and their texts."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream(url, p, tokens), prompts))
    seconds = max(r[1] for r in results)
    return sum(r[2] for r in results) / seconds, [r[0] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", help="a checkpoint directory (default, on CPU only: the random model above)")
    parser.add_argument("--sizes", default=None, help="tensor-parallel sizes, comma-separated (CPU: 1,2; CUDA: 1,2,4,8)")
    parser.add_argument("--streams", default=None, help=f"stream counts, comma-separated (CPU: 1,{STREAMS}; CUDA: 1,64)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readme", type=Path)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu and not args.model:
        parser.error("--device cuda needs --model (a checkpoint directory)")
    sizes = [int(n) for n in (args.sizes or ("1,2,4,8" if gpu else "1,2")).split(",")]
    counts = [int(n) for n in (args.streams or ("1,64" if gpu else f"1,{STREAMS}")).split(",")]
    prompts = [[(37 * i + 101 * s) % 40000 + 3 for i in range(32)] for s in range(max(counts))]
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "m"
        if not args.model:
            build(model)
        flags = ("--model", str(model), "--served-model-name", "m", "--device", args.device, "--dtype", "bfloat16" if gpu else "float32",
                 "--max-running", str(max(counts)), *(() if gpu else ("--kv-budget-bytes", str(BUDGET))))
        with contextlib.ExitStack() as servers:
            started = {}
            for size in sizes:  # on CPU side by side, rounds in turn; on GPUs one size at a time, each on its GPUs
                server = servers.enter_context(launch(Path(tmp), *flags, "--tensor-parallel-size", str(size), ready_timeout_s=3600))
                info = httpx.get(server.url + "/v1/models").json()["data"][0]
                results[size] = {"capacity": info["kv_cache"]["capacity_tokens"], "rates": {n: [] for n in counts}, "texts": []}
                started[size] = server
                if gpu:
                    measure(started, results, prompts, counts, args)
                    servers.close()
                    started = {}
            measure(started, results, prompts, counts, args)
    same = len({tuple(r["texts"]) for r in results.values()}) == 1
    floor = floor_per_gpu(Path(args.model)) if gpu else None
    table = report(results, counts, args, same, floor)
    print(table)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if args.readme:
        write_readme_block(args.readme, README_BEGIN, README_END, table)
    if not same and not gpu:
        raise SystemExit("the servers' greedy texts differ")


def measure(servers: dict, results: dict[int, dict], prompts: list[list[int]], counts: list[int], args) -> None:
    """--repeats rounds, each stream count on each of `servers` in turn."""
    for _ in range(args.repeats if servers else 0):
        for size, server in servers.items():
            texts = []
            for n in counts:
                tokens_per_s, more = rate(server.url, prompts[:n], args.tokens)
                results[size]["rates"][n].append(tokens_per_s)
                texts += more
            results[size]["texts"] = texts


def floor_per_gpu(model: Path) -> float:
    """One stream's tokens/s bound on one GPU: the checkpoint's weight bytes read once per step
    at one GPU's copy bandwidth."""
    from bench.gpu import copy_bandwidth

    nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return copy_bandwidth(torch.device("cuda", 0)) / nbytes


def report(results: dict[int, dict], counts: list[int], args, same: bool, floor: float | None) -> str:
    gpu = floor is not None
    what = (f"{args.model}, bf16, CUDA" if gpu else "Llama-shaped random model (hidden 512, 8 layers, 8 heads over 4 KV heads, vocabulary "
            "49152), fp32, CPU (2 cores: one process with 2 threads, or 2 gloo ranks with 1 each)")
    budget = "measured on each GPU" if gpu else f"`--kv-budget-bytes` {BUDGET // 2**20} MiB per rank"
    header = ["ranks", "KV capacity (tokens, all ranks)", *(f"{n} stream{'s' if n > 1 else ''} (tokens/s)" for n in counts),
              "ms a step (1 stream)", *(f"**{n} stream{'s' if n > 1 else ''} / {min(results)} rank{'s' if min(results) > 1 else ''}**" for n in counts)]
    if gpu:
        header.append("**1 stream / one GPU's floor**")
    lines = [f"{what}, {args.tokens} greedy tokens a stream, medians of {args.repeats} rounds; {budget}. Greedy texts of all "
             f"sizes: {'equal' if same else 'DIFFERENT'}.", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    base = {n: statistics.median(results[min(results)]["rates"][n]) for n in counts}
    for size, r in results.items():
        rates = {n: statistics.median(r["rates"][n]) for n in counts}
        row = [str(size), str(r["capacity"]), *(f"{rates[n]:.1f}" for n in counts), f"{1000 / rates[counts[0]]:.2f}",
               *(f"**{rates[n] / base[n]:.2f}**" for n in counts)]
        if gpu:
            row.append(f"**{rates[counts[0]] / floor:.2f}**")
        lines.append("| " + " | ".join(row) + " |")
    if not gpu and {1, 2} <= set(results):
        one, two = 1000 / base[counts[0]], 1000 / statistics.median(results[2]["rates"][counts[0]])
        lines += ["", f"Per decode step, 2 ranks add {two - one:.2f} ms to one process's {one:.2f} ms (one stream). Each "
                  "rank runs half the model's products, packed and merged as one process runs them, on 1 thread where one "
                  "process has 2; on top come the broadcast of the step's rows and 2 gloo all-reduces a layer (after the "
                  "attention and MLP output projections), one for the embedding and the LM head's gather: about 0.2 ms of CPU "
                  "each over loopback TCP on the dev box, but each waits for the slower rank, and on 2 shared cores a rank "
                  "that waits is woken late. Each rank's pool holds half of every token's KV heads, so the same budget per "
                  "rank holds twice the tokens."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
