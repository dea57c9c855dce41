"""Scale-out behind the router users already run: SMG (`smg launch`, sgl-project's Rust router)
in front of N kvserve replicas, `cache_aware` against `round_robin`, measured in one run.

    .venv/bin/python -m bench.scaleout [--replicas 3] [--sessions 12] [--turns 3] [--doc-tokens 1000]

The same replicas serve both runs; the router is restarted with the other policy and the
sessions get fresh ids (kvserve reuses a cache only within its own session id, so the second
run starts cold). S sessions x T turns, each session with its own ~1k-token document as system
prompt, streamed through the openai SDK with `prompt_cache_key`. The sessions open at once (turn
1 concurrently, as users do); the later turns go one at a time, the sessions in a shuffled
order within each turn (the same in both runs), so round-robin does not land a session on the
same replica by the arithmetic of lockstep traffic. TTFT = request start to the first content
chunk, measured at the client, router included; only later turns are timed. Each router run
starts once SMG has polled every replica's load (see `launch_router`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shlex
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI

from bench.common import Process, free_port, launch, started
from bench.sessions import WORDS, document, stream_turn


def smg_binary() -> str | None:
    """The `smg` console script next to this interpreter (the test extra installs it), else on PATH."""
    local = Path(sys.executable).with_name("smg")
    return str(local) if local.exists() else shutil.which("smg")


class RouterProcess(Process):
    """An `smg launch` process."""

    def readiness(self) -> dict:
        return httpx.get(self.url + "/readiness", timeout=2).json()

    def healthy_workers(self) -> int:
        return self.readiness().get("healthy_workers", 0)

    def workers_with_loads(self) -> set[str]:
        """The workers whose load SMG has polled (its /get_loads lists only those)."""
        return {load["worker"] for load in httpx.get(self.url + "/get_loads", timeout=2).json().get("loads", [])}


def launch_router(log_dir: Path, worker_urls: list[str], policy: str, *flags: str, ready_timeout_s: float = 60):
    """Run `smg launch` on a free port until the block ends (SIGTERM); ready once every worker
    is registered, healthy and load-polled.

    NOTE: until SMG has polled a worker's load, cache_aware's least-loaded pick for a prompt no
    replica holds avoids that worker: a burst of new sessions then lands on the replicas already
    polled. So the router polls every second (--load-monitor-interval 1, as the Helm chart
    sets it; SMG's default is 10 s) and is ready only when it has every worker's load.
    The health check probes /ready (503 while a replica drains after SIGTERM) every second
    and one failure marks a worker unhealthy; a request sent to a replica that is already gone
    is retried on another one by SMG's default retries (connection errors and 5xx). The
    tokenizer autoload is off: in HTTP mode cache_aware matches request text, and nothing may
    be downloaded.
    """
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("the smg router is not installed (pip install 'kvserve[test]')")
    port = free_port()
    cmd = [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--policy", policy, "--worker-urls", *worker_urls,
        "--load-monitor-interval", "1",
        "--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
        "--health-failure-threshold", "1",
        "--disable-tokenizer-autoload", "--shutdown-grace-period-secs", "5",
        "--log-level", "info", *flags,
    ]

    def ready(router: RouterProcess) -> bool:
        return router.healthy_workers() == len(worker_urls) and router.workers_with_loads() >= set(worker_urls)

    return started(
        RouterProcess, cmd, port, Path(log_dir) / f"smg-{policy}-{port}.log", ready,
        env={"NO_COLOR": "1"}, ready_timeout_s=ready_timeout_s, stop_timeout_s=15,
    )


def session_document(i: int, doc_tokens: int) -> str:
    """Session i's own document; its first word differs from every other session's (i < 37)."""
    return f"{WORDS[i % len(WORDS)].capitalize()} notes, part {i}.\n" + document(1000 + i, doc_tokens)


def turn_order(sessions: int, turn: int) -> list[int]:
    order = list(range(sessions))
    random.Random(turn).shuffle(order)
    return order


@dataclass(slots=True)
class Turn:
    session: str
    turn: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int


def run_sessions(base_url: str, tag: str, sessions: int, turns: int, doc_tokens: int, max_tokens: int) -> list[Turn]:
    """S sessions x T turns through `base_url`: turn 1 all at once, later turns one at a time in a
    shuffled order; every turn's record."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    convs = {f"{tag}-{i}": [{"role": "system", "content": session_document(i, doc_tokens)}]
             for i in range(sessions)}
    keys = list(convs)
    records = []

    def advance(turn: int, i: int) -> None:
        session, messages = keys[i], convs[keys[i]]
        messages.append({"role": "user", "content": f"Question {turn + 1}: what does the document say about item {turn + 1}?"})
        ttft, text, usage = stream_turn(client, model, messages, session, max_tokens)
        messages.append({"role": "assistant", "content": text})
        records.append(Turn(session, turn, ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))

    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(advance, [0] * sessions, range(sessions)))
    for turn in range(1, turns):
        for i in turn_order(sessions, turn):
            advance(turn, i)
    return records


def finished_requests(replica) -> float:
    """The sum of kvserve_request_finished_total over its labels (routes, finish reasons)."""
    return sum(float(line.split()[-1]) for line in httpx.get(replica.url + "/metrics").text.splitlines()
               if line.startswith("kvserve_request_finished_total{"))


def holds(replica, session: str) -> bool:
    """Whether the replica has the session's KV cache (keyless: the id is presented as the header)."""
    return bool(httpx.get(replica.base_url + "/sessions", headers={"X-Session-ID": session}).json()["data"])


@dataclass(slots=True)
class PolicyResult:
    policy: str
    later_ttft: float
    hit_share: float  # later turns with cached_tokens > 0
    token_share: float  # later turns' prompt tokens served from cache
    per_replica: list[int]  # requests
    sessions_per_replica: list[int]  # sessions whose cache each replica holds at the end
    prompt_tokens: int


def measure(policy: str, replicas, logs: Path, args) -> PolicyResult:
    before = [finished_requests(r) for r in replicas]
    with launch_router(logs, [r.url for r in replicas], policy) as router:
        records = run_sessions(router.base_url, f"bench-{policy}", args.sessions, args.turns, args.doc_tokens, args.max_tokens)
    later = [r for r in records if r.turn > 0]
    sessions = {r.session for r in records}
    return PolicyResult(
        policy=policy,
        later_ttft=statistics.median(r.ttft for r in later),
        hit_share=sum(r.cached_tokens > 0 for r in later) / len(later),
        token_share=sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
        per_replica=[round(finished_requests(r) - b) for r, b in zip(replicas, before)],
        sessions_per_replica=[sum(holds(r, s) for s in sessions) for r in replicas],
        prompt_tokens=max(r.prompt_tokens for r in records),
    )


def report(args, aware: PolicyResult, rr: PolicyResult) -> None:
    print(f"{args.replicas} kvserve replicas behind smg, {args.sessions} sessions x {args.turns} turns, "
          f"~{aware.prompt_tokens} prompt tokens by the last turn, {args.max_tokens} tokens per answer, "
          "streamed (SmolLM2-135M fp32, CPU)\n")
    print("| router policy | later turns with cached tokens | later-turn prompt tokens from cache "
          "| median later-turn TTFT (s) | requests per replica | sessions cached per replica |")
    print("|---|---|---|---|---|---|")
    for r in (aware, rr):
        print(f"| smg `{r.policy}` | {r.hit_share:.0%} | {r.token_share:.0%} | {r.later_ttft:.3f} "
              f"| {' / '.join(map(str, r.per_replica))} | {' / '.join(map(str, r.sessions_per_replica))} |")
    print(f"| **ratio cache_aware / round_robin** | | | **{aware.later_ttft / rr.later_ttft:.2f}** | | |")
    print("\n    " + shlex.join([".venv/bin/python", "-m", "bench.scaleout", *sys.argv[1:]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="passed to every `kvserve serve`, e.g. --server-flag=--max-running=8 (repeatable)")
    args = parser.parse_args()
    flags = [part for flag in args.server_flag for part in shlex.split(flag)]
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(launch(logs, *flags)) for _ in range(args.replicas)]
        aware = measure("cache_aware", replicas, Path(logs), args)
        rr = measure("round_robin", replicas, Path(logs), args)
    report(args, aware, rr)


if __name__ == "__main__":
    main()
