"""Scale-out: three real kvserve replicas behind the real SMG router (`smg launch --policy
cache_aware`), driven by the official openai SDK through the router.

What SMG 1.13 does with a kvserve worker (seen in its log and the replicas' access logs):
registration reads /health, /v1/models, /version and /server_info (/version makes kvserve a
`vllm` runtime to SMG), then it polls the worker's load from /loads (the first of /loads,
/v1/loads and /metrics that answers), here every second; no call it makes may answer 404.
Requests pass through with their body intact (`prompt_cache_key` included). A request sent to
a replica that is draining (503) or gone (connection refused) is retried on another replica by
SMG's default retries (5), and the 1 s /ready health check takes the replica out of rotation.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from bench.common import launch
from bench.scaleout import holds, launch_router, session_document, smg_binary, turn_order
from tests.conftest import test_cache_dir as cache_dir
from tests.device import SERVE_FLAGS

pytestmark = pytest.mark.e2e

REPLICAS, SESSIONS, TURNS = 3, 12, 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(launch(logs, "--cache-dir", str(cache_dir()), *SERVE_FLAGS)) for _ in range(REPLICAS)]


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    if smg_binary() is None:
        pytest.skip("the smg router binary is not installed (it comes with the test extra)")
    with launch_router(tmp_path_factory.mktemp("router"), [r.url for r in replicas], "cache_aware") as r:
        yield r


@pytest.fixture(scope="module")
def client(router):
    return OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


class Conversations:
    """SESSIONS chats through the router, each with its own short document as system prompt;
    keeps every turn's usage."""

    def __init__(self, client: OpenAI) -> None:
        self.client = client
        self.model = client.models.list().data[0].id
        self.messages = {f"scaleout-{i}": [{"role": "system", "content": session_document(i, 60)}] for i in range(SESSIONS)}
        self.usage: list[tuple[int, str, int, int]] = []  # (turn, session, prompt_tokens, cached_tokens)

    def turn(self, turn: int, sessions: list[str], parallel: bool = False) -> None:
        """One more turn of each session, one after the other (or all at once)."""
        if parallel:
            with ThreadPoolExecutor(len(sessions)) as pool:
                list(pool.map(lambda session: self.turn(turn, [session]), sessions))
            return
        for session in sessions:
            messages = self.messages[session]
            messages.append({"role": "user", "content": f"Question {turn + 1}: what is item {turn + 1}?"})
            out = self.client.chat.completions.create(
                model=self.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, prompt_cache_key=session,
            )
            assert out.choices[0].message.content, f"{session} turn {turn + 1}: empty answer"
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            self.usage.append((turn, session, out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens))


@pytest.fixture(scope="module")
def conversations(client):
    convs = Conversations(client)
    keys = list(convs.messages)
    # NOTE: the sessions open at once, as users do: with nothing cached yet cache_aware places a
    # request on the least loaded replica, counting what it sent each one since its last load
    # poll, so concurrent openers spread evenly (the router is ready only once it has polled
    # every replica: before that, a burst piles onto the replicas already polled).
    convs.turn(0, keys, parallel=True)
    for turn in range(1, TURNS):
        convs.turn(turn, [keys[i] for i in turn_order(SESSIONS, turn)])
    return convs


def answered(replica, status: int) -> set[str]:
    """Paths (without the query) the replica answered with `status`, from uvicorn's access log
    lines: `"GET /path?query HTTP/1.1" 404`."""
    return set(re.findall(rf'"[A-Z]+ ([^\s?]+)\S* HTTP/[\d.]+" {status}', replica.log()))


def test_cache_aware_keeps_each_session_on_its_replica(conversations, replicas, router):
    later = [(turn, session, cached) for turn, session, _, cached in conversations.usage if turn > 0]
    assert len(later) == SESSIONS * (TURNS - 1)
    hits = sum(cached > 0 for _, _, cached in later)
    assert hits >= 0.95 * len(later), f"only {hits} of {len(later)} later turns reused a cache: {later}"
    # every session lives on exactly one replica, and the openers spread over all of them
    holders = {s: [i for i, r in enumerate(replicas) if holds(r, s)] for s in conversations.messages}
    assert all(len(h) == 1 for h in holders.values()), holders
    per_replica = [sum(h == [i] for h in holders.values()) for i in range(REPLICAS)]
    assert min(per_replica) >= SESSIONS // REPLICAS // 2, f"sessions per replica: {per_replica}"
    # SMG's registration probes and load polls find every endpoint it calls
    for r in replicas:
        assert answered(r, 404) == set(), answered(r, 404)
        assert {"/server_info", "/loads", "/v1/chat/completions"} <= answered(r, 200)
    assert "/v1/chat/completions" in router.log()


def test_router_routes_around_a_stopped_replica(conversations, replicas, router):
    victim, survivors = replicas[0], replicas[1:]
    orphans = [s for s in conversations.messages if holds(victim, s)]
    assert orphans, "the replica to stop holds no session; the failover would not be exercised"
    victim.proc.send_signal(signal.SIGTERM)
    # at once, the stopped replica's sessions first: while it drains it answers 503 shutting_down,
    # then its port refuses connections; SMG retries both on another replica until its health
    # check takes the replica out of rotation. Every request must succeed.
    conversations.turn(TURNS, orphans + [s for s in conversations.messages if s not in orphans])
    assert victim.proc.wait(timeout=40) == 0
    moved = {s: cached for turn, s, _, cached in conversations.usage if turn == TURNS and s in orphans}
    kept = {s: cached for turn, s, _, cached in conversations.usage if turn == TURNS and s not in orphans}
    assert all(cached == 0 for cached in moved.values()), moved  # recomputed on a replica without its cache
    assert sum(cached > 0 for cached in kept.values()) >= 0.95 * len(kept), kept
    assert all(any(holds(r, s) for r in survivors) for s in orphans)
    deadline = time.monotonic() + 10
    while router.healthy_workers() != len(survivors):
        assert time.monotonic() < deadline, "the router still counts the stopped replica as healthy"
        time.sleep(0.2)
