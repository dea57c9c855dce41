"""Tensor parallel on CPU (server/parallel.py): what running one model as 2 gloo ranks costs a
decode step against one process on the same cores, and what each rank's KV pool holds.

    .venv/bin/python -m bench.tp [--tokens 64] [--repeats 3] [--readme docs/benchmarks.md]

A correctness-and-overhead figure, not a speed claim: on a CPU the two ranks share the cores one
process would use (each rank 1 thread, the one process 2), so the ratio says what the step's
broadcast (server/engine/lockstep.py) and the forward's all-reduces and gathers cost, nothing
about what more GPUs buy. On several GPUs (none is lent to this project yet) the figure to
measure is tokens/s at 1 and 64 streams for a 70B shape at 2, 4 and 8 ranks against one GPU's
HBM floor: unmeasured.

The model (fp32, seeded random weights, saved to a temporary directory with SmolLM2's
tokenizer): Llama-shaped, hidden 512, 8 layers, 8 query heads over 4 KV heads of 64, MLP 1536,
vocabulary 49152. Two real servers, `--tensor-parallel-size 1` and `2`, with the same
`--kv-budget-bytes` per rank; each round streams a 32-token prompt's --tokens greedy tokens
(end of turn biased away) alone, then 8 such streams at once, on each server in turn. Rate =
the tokens after the first one / the time from the first to the last (prefill left out);
medians of --repeats rounds. The greedy text of both servers is compared (it must be equal).

`--readme FILE` writes the tables into FILE between `<!-- bench.tp: begin -->` and
`<!-- bench.tp: end -->`. About 2 minutes on the 2-core dev box.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readme", type=Path)
    args = parser.parse_args()
    prompts = [[(37 * i + 101 * s) % 40000 + 3 for i in range(32)] for s in range(STREAMS)]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        build(model)
        flags = ("--model", str(model), "--served-model-name", "m", "--device", "cpu", "--dtype", "float32",
                 "--kv-budget-bytes", str(BUDGET), "--max-running", str(STREAMS))
        results: dict[int, dict] = {}
        with launch(Path(tmp), *flags, "--tensor-parallel-size", "1") as one, launch(Path(tmp), *flags, "--tensor-parallel-size", "2") as two:
            servers = {1: one, 2: two}
            for size, server in servers.items():
                info = httpx.get(server.url + "/v1/models").json()["data"][0]
                results[size] = {"capacity": info["kv_cache"]["capacity_tokens"], "alone": [], "many": [], "texts": None}
            for _ in range(args.repeats):
                for size, server in servers.items():
                    alone, texts = rate(server.url, prompts[:1], args.tokens)
                    many, more = rate(server.url, prompts, args.tokens)
                    results[size]["alone"].append(alone)
                    results[size]["many"].append(many)
                    results[size]["texts"] = texts + more
    same = results[1]["texts"] == results[2]["texts"]
    table = report(results, args, same)
    print(table)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if args.readme:
        write_readme_block(args.readme, README_BEGIN, README_END, table)
    if not same:
        raise SystemExit("the two servers' greedy texts differ")


def report(results: dict[int, dict], args, same: bool) -> str:
    lines = [
        f"Llama-shaped random model (hidden 512, 8 layers, 8 heads over 4 KV heads, vocabulary 49152), fp32, CPU (2 cores: one "
        f"process with 2 threads, or 2 gloo ranks with 1 each), {args.tokens} greedy tokens a stream, medians of {args.repeats} "
        f"rounds; `--kv-budget-bytes` {BUDGET // 2**20} MiB per rank. Greedy texts of both: {'equal' if same else 'DIFFERENT'}.",
        "",
        "| ranks | KV capacity (tokens, all ranks) | 1 stream (tokens/s) | ms a step | 8 streams (tokens/s) | **1 stream / one process** | **8 streams / one process** |",
        "|---|---|---|---|---|---|---|",
    ]
    base_alone, base_many = statistics.median(results[1]["alone"]), statistics.median(results[1]["many"])
    for size, r in results.items():
        alone, many = statistics.median(r["alone"]), statistics.median(r["many"])
        lines.append(f"| {size} | {r['capacity']} | {alone:.1f} | {1000 / alone:.2f} | {many:.1f} | **{alone / base_alone:.2f}** | **{many / base_many:.2f}** |")
    step_one, step_two = 1000 / base_alone, 1000 / statistics.median(results[2]["alone"])
    lines += ["", f"Per decode step, 2 ranks add {step_two - step_one:.2f} ms to one process's {step_one:.2f} ms (one stream): the "
              "broadcast of the step's rows, then per layer the gloo all-reduces after the attention and MLP output "
              "projections (about 0.35 ms each over loopback TCP on the dev box, each waiting for the slower rank) and the "
              "LM head's gather, with 1 thread a rank for the products. Each rank's pool holds half of every token's KV heads, so the same "
              "budget per rank holds twice the tokens."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
