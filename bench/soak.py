"""A soak: N minutes of mixed traffic against one real server, a restart half-way, and what is
left afterwards (5xx, requests that never ended, replays, RSS, gauges).

    .venv/bin/python -m bench.soak --minutes 30 [--clients 4] [--readme docs/benchmarks.md]

One `kvserve serve` (SmolLM2, a 200 MB KV budget, the disk tier in a temporary directory,
`KVSERVE_TEST_FAULTS=requests`) and `--clients` concurrent clients, each drawing its next
request at random from:

* session turns, multi-turn chats named by `prompt_cache_key` or `X-Session-ID`, streamed or
  not; structured output (`json_schema` from /work/shared/data/jsonschemabench, each reply
  validated when it stopped by itself); tool calls (auto, required, named) and a follow-up with
  the tool's result; Responses API turns chained by `previous_response_id`;
* streams cancelled after a few chunks; malformed bodies and a 1 MB message (a 4xx each);
* greedy replays: prompts answered alone at warm-up, asked again under load, compared;
* injected faults (`X-Kvserve-Test-Fault: forward | sample | oom`): a 500 for that request
  alone for the first two, and an answer for `oom` (the engine shrinks the step);

plus a burst past the queue every `--burst-every-s` (429s expected). Half-way the clients stop,
the server gets SIGTERM and a new one starts on the same `--kv-disk-dir`; each live chat's next
turn must then come back from the disk tier (`cached_tokens` > 0) and equal a recomputation.
After the load: the running/waiting gauges must read 0, and once the sessions' TTL has passed
(they are on disk by then) RSS is compared with its value after the warm-up. RSS is sampled from
/proc every `--sample-s` seconds throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema

from bench.common import ServerProcess, launch, write_readme_block
from bench.sessions import document
from server.engine import faults

README_START, README_END = "<!-- bench.soak:start -->", "<!-- bench.soak:end -->"
SCHEMA_DIRS = [p / "shared" / "data" / "jsonschemabench" for p in (Path(__file__).resolve().parents[2], Path("/work"))]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ORACLE = [f"In one sentence: why might a {w} matter to a {v}?" for w, v in (
    ("lantern", "keeper"), ("ledger", "captain"), ("compass", "miller"), ("beacon", "sailor"), ("orchard", "farmer"),
    ("bridge", "clerk"), ("ferry", "pilot"), ("archive", "mason"), ("granite", "fisher"), ("harbor", "ranger"))]
KINDS = {"session": 30, "structured": 12, "tools": 10, "responses": 10, "cancel": 8, "malformed": 8,
         "big": 2, "fault": 6, "replay": 14}


def malformed_bodies(model: str) -> list[tuple[str, bytes]]:
    """(path, body) pairs every one of which must get a 4xx."""
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        ("/v1/chat/completions", {"model": model}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": -5}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "temperature": "hot"}),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": msgs}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "tools": [{"type": "function"}]}),
        ("/v1/completions", {"model": model, "prompt": [10**9]}),
        ("/v1/responses", {"model": model, "input": 123}),
        ("/v1/responses", {"model": model, "input": "hi", "previous_response_id": "resp_does_not_exist"}),
    ]
    return [(path, json.dumps(body).encode()) for path, body in bad] + [("/v1/chat/completions", b'{"model": "x", "messages": [')]


def load_schemas(limit: int) -> list[dict]:
    """The smallest schemas of the benchmark's easy sets (those the server refuses are dropped
    when it does)."""
    root = next((d for d in SCHEMA_DIRS if d.is_dir()), None)
    if root is None:
        return [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}]
    files = sorted((p for d in ("Github_trivial", "Github_easy") for p in (root / d).glob("*.json")), key=lambda p: p.stat().st_size)
    return [json.loads(p.read_text()) for p in files[:limit]]


class RssSampler(threading.Thread):
    """VmRSS of the current server process every `every_s` seconds: (seconds since start, MiB)."""

    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.pid, self.t0 = every_s, None, time.monotonic()
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            if self.pid is not None and (mib := rss_mib(self.pid)) is not None:
                self.samples.append((time.monotonic() - self.t0, mib))


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics, keyed by its name with labels as written."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@dataclass
class Conversation:
    sid: str
    messages: list[dict]
    by_header: bool  # X-Session-ID instead of prompt_cache_key
    turns: int = 0
    last: float = 0.0  # time.monotonic() of its last answered turn


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome)
    unexpected: list[str] = field(default_factory=list)  # 5xx outside injected faults, invalid outputs
    never_ended: int = 0
    replays: list[bool] = field(default_factory=list)
    resumed: list[bool] = field(default_factory=list)  # after the restart: cached_tokens > 0
    restored_same: list[bool] = field(default_factory=list)  # ... and equal to a recomputation


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.tally = Tally()
        self.schemas = load_schemas(40)
        self.oracle: dict[str, str] = {}
        self.chats: list[Conversation] = []
        self.chains: dict[int, str | None] = {}
        self.server: ServerProcess | None = None
        self.model = ""
        self.serial = 0

    # -- one request ---------------------------------------------------------------------------

    async def call(self, http: httpx.AsyncClient, kind: str, path: str, body: dict | bytes, headers: dict | None = None):
        """POST and wait for the whole answer (or the stream's end) within the timeout:
        (status, JSON body or the stream's text and usage); (None, None) if it never ended."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                if isinstance(body, dict) and body.get("stream"):
                    return await self._stream(http, path, content, hdrs)
                r = await http.post(self.server.url + path, content=content, headers=hdrs)
                return r.status_code, _json(r)
        except (TimeoutError, httpx.HTTPError) as exc:
            self.tally.never_ended += 1
            self.tally.unexpected.append(f"{kind}: never ended ({type(exc).__name__})")
            return None, None

    async def _stream(self, http, path, content, hdrs):
        text, usage, done = "", None, False
        async with http.stream("POST", self.server.url + path, content=content, headers=hdrs) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, _json(r)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        text += chunk["choices"][0]["delta"]["content"]
                    usage = chunk.get("usage") or usage
        if not done:
            raise httpx.RemoteProtocolError("stream ended without [DONE]")
        return 200, {"choices": [{"message": {"content": text}}], "usage": usage}

    def expect(self, kind: str, status, data, ok=(200,)) -> bool:
        """Count the outcome; a 5xx (or a status outside `ok` and 4xx) is unexpected."""
        if status is None:
            return False
        self.tally.outcomes[kind, str(status)] += 1
        if status >= 500 or (status not in ok and not 400 <= status < 500):
            self.tally.unexpected.append(f"{kind}: {status} {json.dumps(data)[:200]}")
        return status in ok

    # -- the kinds of traffic ------------------------------------------------------------------

    def chat_body(self, content: str, max_tokens: int = 24, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **extra}

    async def session(self, http, rng: random.Random, conv: Conversation | None = None) -> tuple[str, int] | None:
        """The next turn of one of the live chats (a new one sometimes): (reply, cached tokens)."""
        if conv is None:
            live = [c for c in self.chats if c.turns < 6]
            if not live or rng.random() < 0.2 or len(live) < self.args.clients:
                self.serial += 1
                conv = Conversation(f"soak-{self.serial}-{rng.getrandbits(32):08x}",
                                    [{"role": "system", "content": "Answer from this document.\n" + document(self.serial, rng.choice((200, 600, 1200)))}],
                                    by_header=rng.random() < 0.5)
                self.chats.append(conv)
            else:
                conv = rng.choice(live)
        messages = [*conv.messages, {"role": "user", "content": f"Question {conv.turns}: what does it say about item {conv.turns}?"}]
        body = {"model": self.model, "messages": messages, "max_tokens": 24, "temperature": 0}
        headers = {"X-Session-ID": conv.sid} if conv.by_header else {}
        if not conv.by_header:
            body["prompt_cache_key"] = conv.sid
        if rng.random() < 0.5:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        conv.turns += 1  # NOTE: taken before the call: two clients never write one chat's next turn
        status, data = await self.call(http, "session", "/v1/chat/completions", body, headers)
        if not self.expect("session", status, data, ok=(200, 429)) or status != 200:
            return None
        reply = data["choices"][0]["message"]["content"] or ""
        conv.messages = [*messages, {"role": "assistant", "content": reply}]
        conv.last = time.monotonic()
        return reply, data["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def structured(self, http, rng):
        schema = rng.choice(self.schemas)
        body = self.chat_body("Give an example JSON object for this schema.", 96,
                              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        status, data = await self.call(http, "structured", "/v1/chat/completions", body)
        if status == 400 and schema in self.schemas and len(self.schemas) > 1:
            self.schemas.remove(schema)  # refused with a reason: a client error, not this soak's subject
        if self.expect("structured", status, data, ok=(200, 400, 429)) and status == 200:
            choice = data["choices"][0]
            if choice["finish_reason"] == "stop":
                try:
                    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
                    if not isinstance(exc, jsonschema.SchemaError):
                        self.tally.unexpected.append(f"structured: invalid output {str(exc)[:120]}")

    async def tools(self, http, rng):
        choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
        body = self.chat_body("What is the weather in Paris? Use the tool.", 48, tools=[WEATHER], tool_choice=choice)
        status, data = await self.call(http, "tools", "/v1/chat/completions", body)
        if not self.expect("tools", status, data, ok=(200, 429)) or status != 200:
            return
        message = data["choices"][0]["message"]
        for call in message.get("tool_calls") or []:
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                if data["choices"][0]["finish_reason"] != "length":
                    self.tally.unexpected.append(f"tools: arguments not JSON {call['function']['arguments'][:80]}")
                return
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            follow = {**body, "tool_choice": "none", "messages": [*body["messages"], message,
                      {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]}
            status, data = await self.call(http, "tools", "/v1/chat/completions", follow)
            self.expect("tools", status, data, ok=(200, 429))

    async def responses(self, http, rng, client: int):
        body = {"model": self.model, "input": f"Say something about item {rng.randint(0, 99)}.", "max_output_tokens": 16,
                "temperature": 0, "store": True}
        if self.chains.get(client) and rng.random() < 0.75:
            body["previous_response_id"] = self.chains[client]
        status, data = await self.call(http, "responses", "/v1/responses", body)
        if self.expect("responses", status, data, ok=(200, 429)) and status == 200:
            self.chains[client] = data["id"]

    async def cancel(self, http, rng):
        body = self.chat_body("Tell me a long story about a harbor.", 256, stream=True)
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                async with http.stream("POST", self.server.url + "/v1/chat/completions", json=body) as r:
                    self.tally.outcomes["cancel", str(r.status_code)] += 1
                    if r.status_code >= 500:
                        self.tally.unexpected.append(f"cancel: {r.status_code}")
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if n >= rng.randint(2, 8):
                            break  # closing the stream aborts the request
        except (TimeoutError, httpx.HTTPError) as exc:
            self.tally.never_ended += 1
            self.tally.unexpected.append(f"cancel: never ended ({type(exc).__name__})")

    async def malformed(self, http, rng):
        path, body = rng.choice(malformed_bodies(self.model))
        status, data = await self.call(http, "malformed", path, body)
        self.expect("malformed", status, data, ok=())

    async def big(self, http, rng):
        status, data = await self.call(http, "big", "/v1/chat/completions", self.chat_body("word " * 200_000))
        self.expect("big", status, data, ok=())

    async def fault(self, http, rng):
        kind = rng.choice(faults.KINDS)
        prompt = "Summarise: " + document(rng.randint(0, 999), 80)  # past OOM_TOKENS: the oom fires in its prefill
        status, data = await self.call(http, "fault", "/v1/chat/completions", self.chat_body(prompt, 16), {faults.HEADER: kind})
        if status is None:
            return
        self.tally.outcomes[f"fault:{kind}", str(status)] += 1
        code = (data or {}).get("error", {}).get("code") if isinstance(data, dict) else None
        expected = status == 200 or (status == 500 and code in ("internal_error", "out_of_memory")) or status == 429
        if kind == "oom" and status == 500:
            expected = False  # one row's prefill always fits alone once the step shrinks
        if not expected:
            self.tally.unexpected.append(f"fault {kind}: {status} {json.dumps(data)[:200]}")

    async def replay(self, http, rng):
        prompt = rng.choice(ORACLE)
        status, data = await self.call(http, "replay", "/v1/chat/completions", self.chat_body(prompt))
        if self.expect("replay", status, data, ok=(200, 429)) and status == 200:
            self.tally.replays.append(data["choices"][0]["message"]["content"] == self.oracle[prompt])

    async def burst(self, http):
        """`--burst` tiny requests at once: more than running + waiting hold, so some get 429."""
        results = await asyncio.gather(*(self.call(http, "burst", "/v1/chat/completions", self.chat_body(f"Count to {i}.", 4))
                                         for i in range(self.args.burst)))
        for status, data in results:
            self.expect("burst", status, data, ok=(200, 429))

    # -- phases --------------------------------------------------------------------------------

    async def warm_up(self, http) -> None:
        """One request of each kind alone; the oracle's answers on the first server."""
        rng = random.Random(0)
        if not self.oracle:
            for prompt in ORACLE:
                status, data = await self.call(http, "replay", "/v1/chat/completions", self.chat_body(prompt))
                assert status == 200, (status, data)
                self.oracle[prompt] = data["choices"][0]["message"]["content"]
        for kind in ("session", "structured", "tools", "cancel", "malformed", "replay"):
            await getattr(self, kind)(http, rng)
        await self.responses(http, rng, -1)

    async def resume(self, http) -> None:
        """After the restart: each live chat's next turn comes from the disk tier and equals the
        same turn recomputed under a new session id."""
        rng = random.Random(1)
        # NOTE: only chats still within their TTL when the first server stopped were written
        recent = sorted((c for c in self.chats if c.turns < 6 and time.monotonic() - c.last < self.args.ttl_s / 2),
                        key=lambda c: c.last)[-8:]
        answered = []
        for conv in recent:  # every first turn before any recomputation: the TTL runs on disk too
            got = await self.session(http, rng, conv)
            if got is not None:
                self.tally.resumed.append(got[1] > 0)
                answered.append((conv, got))
        for conv, got in answered:
            fresh = {"model": self.model, "messages": conv.messages[:-1], "max_tokens": 24, "temperature": 0,
                     "prompt_cache_key": f"recompute-{conv.sid}"}
            status, data = await self.call(http, "session", "/v1/chat/completions", fresh)
            if self.expect("session", status, data):
                self.tally.restored_same.append(data["choices"][0]["message"]["content"] == got[0])

    async def load(self, until: float) -> None:
        """`--clients` clients and the bursts until `until` (time.monotonic()); every request
        started is waited for."""
        limits = httpx.Limits(max_connections=self.args.burst + self.args.clients + 8)
        async with httpx.AsyncClient(limits=limits, timeout=None) as http:
            async def client(i: int) -> None:
                rng = random.Random(1000 + i + int(until))
                kinds, weights = zip(*KINDS.items())
                while time.monotonic() < until:
                    kind = rng.choices(kinds, weights)[0]
                    try:
                        await (self.responses(http, rng, i) if kind == "responses" else getattr(self, kind)(http, rng))
                    except (KeyError, TypeError, IndexError, ValueError) as exc:  # an answer of the wrong shape
                        self.tally.unexpected.append(f"{kind}: malformed answer ({type(exc).__name__}: {exc})")

            async def bursts() -> None:
                while time.monotonic() + self.args.burst_every_s < until:
                    await asyncio.sleep(self.args.burst_every_s)
                    await self.burst(http)

            async def progress() -> None:
                while time.monotonic() < until:
                    await asyncio.sleep(min(30, max(0.1, until - time.monotonic())))
                    log(f"{sum(self.tally.outcomes.values())} requests, {len(self.tally.unexpected)} unexpected, "
                        f"RSS {rss_mib(self.server.proc.pid) or 0:.0f} MiB")

            await asyncio.gather(bursts(), progress(), *(client(i) for i in range(self.args.clients)))

    async def start(self, server: ServerProcess, resume: bool) -> None:
        self.server = server
        async with httpx.AsyncClient(timeout=None) as http:
            self.model = (await http.get(server.url + "/v1/models")).json()["data"][0]["id"]
            if resume:
                await self.resume(http)
            await self.warm_up(http)


T0 = time.monotonic()


def log(line: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f} s] {line}", file=sys.stderr, flush=True)


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return {"text": r.text[:200]}


def wait_for(predicate, timeout_s: float, every_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def settle(server: ServerProcess, ttl_s: float) -> dict:
    """After the load: the gauges once nothing runs, then RSS once the sessions' TTL passed."""
    def gauges():
        m = scrape(server)
        return m["kvserve_requests_running"], m["kvserve_requests_waiting"]
    idle = wait_for(lambda: gauges() == (0, 0), 60)
    running, waiting = gauges()
    rss_idle = rss_mib(server.proc.pid)
    wait_for(lambda: scrape(server)["kvserve_sessions_resident"] == 0, ttl_s + 30, 2)
    time.sleep(5)
    m = scrape(server)
    return {"idle": idle, "running": running, "waiting": waiting, "rss_idle": rss_idle, "rss_end": rss_mib(server.proc.pid),
            "resident": m["kvserve_sessions_resident"], "disk_sessions": m['kvserve_kv_tier_sessions{tier="disk"}'],
            "disk_bytes": m.get("kvserve_kv_disk_file_bytes", 0.0), "disk_budget": m['kvserve_kv_tier_budget_bytes{tier="disk"}'],
            "process_rss": m.get("process_resident_memory_bytes", 0.0) / 2**20}


def settled_rss(sampler: RssSampler, pid: int, wait_s: float = 3.0) -> float:
    time.sleep(wait_s)
    return rss_mib(pid) or 0.0


def report(args, soak: Soak, end: dict, rss: dict, sampler: RssSampler, exit_code) -> str:
    t = soak.tally
    total = sum(t.outcomes.values())
    by_status = Counter()
    for (kind, status), n in t.outcomes.items():
        by_status["injected faults" if kind.startswith("fault:") else f"{status[0]}xx" if status.isdigit() else status] += n
    fault_rows = ", ".join(f"{k.split(':')[1]} → {s}: {n}" for (k, s), n in sorted(t.outcomes.items()) if k.startswith("fault:"))
    expected_4xx = sum(n for (k, s), n in t.outcomes.items() if s.startswith("4") and not k.startswith("fault:"))
    minutes = [f"{mib / 1024:.2f}" for _, mib in _per_minute(sampler.samples)]
    server_5xx = sum(n for (k, s), n in t.outcomes.items() if s.startswith("5") and not k.startswith("fault:"))
    lines = [
        (f"{args.minutes:g} minutes, {args.clients} clients, bursts of {args.burst} every {args.burst_every_s:g} s, "
         f"a restart at half-way; SmolLM2-135M fp32 on CPU, --kv-budget-bytes {args.kv_budget_bytes}"),
        "",
        "| measure | value |",
        "|---|---|",
        f"| requests | {total} ({', '.join(f'{k} {n}' for k, n in sorted(Counter(k.split(':')[0] for (k, _), n in t.outcomes.items() for _ in range(n)).items()))}) |",
        f"| by status | {', '.join(f'{k} {n}' for k, n in sorted(by_status.items()))} |",
        f"| 4xx expected (malformed, 1 MB, refused schemas, 429) | {expected_4xx} |",
        f"| **5xx outside injected faults** | **{server_5xx}** |",
        f"| injected faults | {fault_rows or 'none'} |",
        f"| **requests that never ended** | **{t.never_ended}** |",
        f"| other unexpected (invalid outputs) | {len(t.unexpected) - server_5xx - t.never_ended} |",
        f"| greedy replays identical | {sum(t.replays)}/{len(t.replays)} |",
        f"| chats resumed from disk after the restart | {sum(t.resumed)}/{len(t.resumed)} (first server exit code {exit_code}) |",
        f"| restored turns identical to a recomputation | {sum(t.restored_same)}/{len(t.restored_same)} |",
        f"| gauges after the load (running, waiting) | {end['running']:g}, {end['waiting']:g} |",
        f"| RSS after warm-up (first / second server) | {rss['warm1']:.0f} / {rss['warm2']:.0f} MiB |",
        f"| RSS peak (first / second server) | {rss['peak1']:.0f} / {rss['peak2']:.0f} MiB |",
        f"| RSS when the load stopped | {end['rss_idle']:.0f} MiB |",
        (f"| **RSS once sessions expired (TTL {args.ttl_s:g} s) / after warm-up** | **{end['rss_end']:.0f} MiB / "
         f"{rss['warm2']:.0f} MiB ({end['rss_end'] / rss['warm2']:.2f}x)** |"),
        (f"| disk tier at the end | {end['disk_sessions']:g} sessions, {end['disk_bytes'] / 2**20:.0f} MiB of files, "
         f"budget {end['disk_budget'] / 2**30:.1f} GiB |"),
        f"| RSS each minute (GiB) | {' '.join(minutes)} |",
    ]
    return "\n".join(lines)


def _per_minute(samples: list[tuple[float, float]]) -> list[tuple[int, float]]:
    out: dict[int, float] = {}
    for t, mib in samples:
        out.setdefault(int(t // 60), mib)
    return sorted(out.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--burst", type=int, default=64, help="requests in one burst (past --max-running 16 + --max-queue 32)")
    parser.add_argument("--burst-every-s", type=float, default=60)
    parser.add_argument("--kv-budget-bytes", type=int, default=200_000_000)
    parser.add_argument("--ttl-s", type=float, default=300, help="the server's --session-ttl-s (the end waits for it)")
    parser.add_argument("--request-timeout-s", type=float, default=300, help="a request not answered by then never ended")
    parser.add_argument("--sample-s", type=float, default=2)
    parser.add_argument("--readme", type=Path, help="write the table into this README between the markers")
    parser.add_argument("--keep", type=Path, help="keep the servers' logs and the disk tier here (default: a temporary directory)")
    args = parser.parse_args()
    soak, sampler, rss = Soak(args), RssSampler(args.sample_s), {}
    sampler.start()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep or scratch)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        flags = ("--kv-budget-bytes", str(args.kv_budget_bytes), "--max-model-len", "4096", "--kv-disk-dir", str(Path(tmp) / "kv"),
                 "--session-ttl-s", str(args.ttl_s), "--max-queue", "32", "--kv-persist-interval-s", "30")
        env = {faults.ENV: "requests"}
        for n in (1, 2):
            with launch(tmp, *flags, env=env) as server:
                sampler.pid = server.proc.pid
                log(f"server {n} ready")
                asyncio.run(soak.start(server, resume=n == 2))
                rss[f"warm{n}"] = settled_rss(sampler, server.proc.pid)
                log(f"server {n} warmed up: RSS {rss[f'warm{n}']:.0f} MiB")
                mark = len(sampler.samples)
                asyncio.run(soak.load(time.monotonic() + args.minutes * 30))  # half the load on each server
                if n == 2:
                    log("load stopped; waiting for the gauges and the sessions' TTL")
                    end = settle(server, args.ttl_s)
                rss[f"peak{n}"] = max((mib for _, mib in sampler.samples[mark:]), default=rss[f"warm{n}"])
            if n == 1:
                exit_code = server.proc.returncode
    sampler.stopped.set()
    table = report(args, soak, end, rss, sampler, exit_code)
    print(table)
    if soak.tally.unexpected:
        print("\nunexpected:\n" + "\n".join(f"  {u}" for u in soak.tally.unexpected[:50]))
    if args.readme:
        write_readme_block(args.readme, README_START, README_END, table)


if __name__ == "__main__":
    main()
