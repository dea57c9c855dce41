"""Before and after: decode speed of an earlier commit's server against this working tree's,
measured in one run, rounds interleaved (A, B, A, B, ...) so that drift of a noisy machine falls
on both sides alike.

    .venv/bin/python -m bench.ab [--before REV] [--rounds 3] [--tokens 128] [--streams 8]

`--before` (default HEAD) is checked out into a temporary git worktree and served by the same
Python environment; "after" is this checkout as it is. Each round starts each side's server
(`kvserve serve`, the default model unless --server-flag says otherwise), measures one greedy
stream's decode rate (bench.decode's: end-of-turn suppressed, first to last chunk) and the
aggregate tokens/s of --streams greedy streams started together (sum of completion tokens over
the wave's wall time), then stops it. Prints per-side medians and after/before ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from bench.common import ServerProcess, free_port, started
from bench.decode import server_rate

ROOT = Path(__file__).resolve().parent.parent


def serve_in(checkout: Path, cmd: list[str], port: int, log_dir: Path):
    """`cmd` (a server on `port`) run from `checkout`, its code first on the path."""
    shell = ["/bin/sh", "-c", f'cd "{checkout}" && exec "$@"', "sh", *cmd]
    return started(ServerProcess, shell, port, log_dir / f"{checkout.name}-{port}.log",
                   lambda s: httpx.get(s.url + "/ready", timeout=2).status_code == 200,
                   env={"PYTHONPATH": str(checkout)})


def streams_rate(client: OpenAI, model: str, n: int, tokens: int) -> float:
    def one(i: int) -> int:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me story number {i} about a harbour."}],
            max_tokens=tokens, temperature=0, logit_bias={"2": -100})
        return out.usage.completion_tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(one, range(n)))
    return total / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {side: {"single": [], "streams": []} for side in ("before", "after")}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True, capture_output=True)
        try:
            sides = {"before": before, "after": ROOT}
            for _ in range(args.rounds):
                for side, checkout in sides.items():
                    with serve_in(checkout, [sys.executable, "-m", "server.cli", "serve", "--port", str(port := free_port()), *args.server_flag], port, Path(tmp)) as server:
                        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
                        model = client.models.list().data[0].id
                        results[side]["single"].append(server_rate(client, model, args.tokens))
                        results[side]["streams"].append(streams_rate(client, model, args.streams, args.tokens))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.before], capture_output=True, text=True).stdout.strip()
    print(f"before = {rev}, after = working tree; {args.rounds} interleaved rounds, medians; {os.cpu_count()} CPUs")
    print("| measure | before tok/s | after tok/s | after / before |")
    print("|---|---|---|---|")
    for key, label in (("single", "1 stream decode"), ("streams", f"{args.streams} streams aggregate")):
        b, a = statistics.median(results["before"][key]), statistics.median(results["after"][key])
        print(f"| {label} | {b:.1f} | {a:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
