"""End to end: a real `kvserve serve` process (an API key, one running sequence, one waiting
slot) driven by the official anthropic SDK as a Claude Code-like client would: `x-api-key`,
messages.create / stream / count_tokens, a stream cut off by the client (aborted, freed), and a
full queue answered 529 `overloaded_error`, which the SDK raises as OverloadedError."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI

from bench.common import launch
from tests import conftest
from tests.device import SERVE_FLAGS
from tests.e2e.test_openai_sdk import MESSAGES, MODEL, NO_EOS

KEY = {"Authorization": "Bearer key-a"}
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    flags = ("--api-key", "key-a", "--max-running", "1", "--max-queue", "1")
    with launch(tmp_path_factory.mktemp("server"), "--cache-dir", str(conftest.test_cache_dir()), *SERVE_FLAGS, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def client(guarded_server):
    return Anthropic(base_url=guarded_server.url, api_key="key-a", max_retries=0)


def test_create_stream_and_count_tokens(client):
    whole = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"temperature": 0})
    assert whole.content[0].type == "text" and whole.usage.output_tokens == 8 and whole.stop_reason == "max_tokens"
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
    assert text == whole.content[0].text
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        Anthropic(base_url=client.base_url, api_key="key-b", max_retries=0).messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)


def _finished(server, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics", headers=KEY).text.splitlines():
        if line.startswith("kvserve_request_finished_total") and f'finish_reason="{reason}"' in line and '"/v1/messages"' in line:
            return float(line.split()[-1])
    raise AssertionError("no /v1/messages series")


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (server.metric("kvserve_requests_running", KEY), server.metric("kvserve_requests_waiting", KEY)) != (0, 0):
        assert time.monotonic() < deadline, "a sequence is still running"
        time.sleep(0.05)


def test_a_client_gone_mid_stream_leaves_nothing_behind(client, guarded_server):
    aborted = _finished(guarded_server, "abort")
    with client.messages.stream(model=MODEL, messages=STORY, max_tokens=1500, extra_body={"temperature": 0}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break  # leaving the block closes the connection
    _wait_idle(guarded_server)
    deadline = time.monotonic() + 10  # the server notices the closed stream at its next write
    while _finished(guarded_server, "abort") <= aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _finished(guarded_server, "abort") == aborted + 1
    assert client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2).content  # still serving


def test_a_full_queue_is_529_overloaded(client, guarded_server):
    stop = threading.Event()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "temperature": 0, "logit_bias": NO_EOS, "stream": True}

    def occupy():  # streams until told to stop, then leaves (the server aborts it)
        with httpx.stream("POST", guarded_server.base_url + "/chat/completions", json=body, headers=KEY, timeout=60) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=occupy) for _ in range(2)]
    try:
        for t, state in zip(threads, [(1, 0), (1, 1)]):
            t.start()  # the first one runs, then the second one waits
            deadline = time.monotonic() + 30
            while (guarded_server.metric("kvserve_requests_running", KEY), guarded_server.metric("kvserve_requests_waiting", KEY)) != state:
                assert time.monotonic() < deadline, f"never {state} running and waiting"
                time.sleep(0.02)
        with pytest.raises(anthropic.APIStatusError) as err:
            client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
    assert err.value.response.headers["retry-after"]
    _wait_idle(guarded_server)
