"""End to end: a real `kvserve serve` process, the official openai SDK, and curl-like httpx."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from tests.device import DEVICE

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
NO_EOS = {"2": -100}  # <|im_end|> never sampled: the request runs until max_tokens


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_the_start_up_heap_is_frozen(server):
    """A serving process takes what start-up left alive (torch, transformers, the model, the
    tokenizer) out of the garbage collector's full collections before it serves
    (server/memory.py `freeze_heap`)."""
    frozen = re.search(r"(\d+) objects alive at start-up frozen", server.log())
    assert frozen is not None and int(frozen.group(1)) > 100_000, server.log()[-4000:]


def test_chat_greedy_equals_transformers_generate(client, smollm2):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30)
    text = smollm2.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    ref = smollm2.model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=30, do_sample=False)[0, len(ids):]
    assert out.choices[0].message.content == smollm2.tokenizer.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_matches_non_stream(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [plain.choices[0].finish_reason]


def test_completions_n_stop_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"], n=2, logprobs=2)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert " 7" not in choice.text and choice.text.startswith(" 5, 6,")
        assert len(choice.logprobs.top_logprobs[0]) == 2
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 5
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_seeded_sampling_reproducible(client):
    def draw(seed):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16, seed=seed, n=2)
        return [c.message.content for c in out.choices]

    first, again, other = draw(11), draw(11), draw(12)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # the n choices of one request are different draws


def test_errors_raise_matching_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9000)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[999999])
    assert err.value.param == "prompt"


def test_stream_disconnect_aborts_and_frees(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    aborted_before = _aborted(server)
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 6:
                break  # leaving the block closes the connection
    _wait_idle(server)
    deadline = time.monotonic() + 10  # the server notices the closed stream at its next write
    while _aborted(server) <= aborted_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted(server) == aborted_before + 1  # the cut-off stream is in the finished metrics


def test_non_stream_disconnect_aborts_and_frees(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "logit_bias": NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", json=body, timeout=1.5)
    _wait_idle(server)
    assert _aborted(server) >= 1


def _aborted(server) -> float:
    """kvserve_request_finished_total for aborted chat requests."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("kvserve_request_finished_total") and 'finish_reason="abort"' in line and '"/v1/chat/completions"' in line:
            return float(line.split()[-1])
    raise AssertionError("no aborted-requests series")


def _wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("kvserve_requests_running") == 0 and server.metric("kvserve_requests_waiting") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the aborted sequence is still running")


def test_curl_like_raw_http(server):
    r = httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(server.base_url + "/chat/completions", content=b"[]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- a server with API keys, one running slot, one waiting slot, a 4 s deadline -------------

def test_auth_on(guarded_server):
    no_key = OpenAI(base_url=guarded_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        no_key.models.list()
    assert err.value.code == "invalid_api_key"
    assert httpx.get(guarded_server.url + "/health").status_code == 200
    assert httpx.get(guarded_server.url + "/metrics").status_code == 401
    good = OpenAI(base_url=guarded_server.base_url, api_key="key-a", max_retries=0)
    assert good.models.list().data[0].id == MODEL
    # aliases are accepted as the model name
    out = good.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2)
    assert out.model == "smol"


def test_queue_full_is_429_with_retry_after_and_deadline_is_504(guarded_server):
    client = OpenAI(base_url=guarded_server.base_url, api_key="key-a", max_retries=0)
    results = {}

    def long_request(name):
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3000, temperature=0, logit_bias=NO_EOS)
            results[name] = "done"
        except openai.APIStatusError as exc:
            results[name] = exc

    key = {"Authorization": "Bearer key-a"}
    threads = [threading.Thread(target=long_request, args=(f"t{i}",)) for i in range(2)]
    for t, (running, waiting) in zip(threads, [(1, 0), (1, 1)]):
        t.start()  # the first one runs, then the second one waits
        deadline = time.monotonic() + 30
        while (guarded_server.metric("kvserve_requests_running", key), guarded_server.metric("kvserve_requests_waiting", key)) != (running, waiting):
            assert time.monotonic() < deadline, f"never {running} running and {waiting} waiting"
            time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert err.value.code == "queue_full"
    assert err.value.response.headers["retry-after"]
    for t in threads:
        t.join(timeout=30)
    # both long requests ran into the 4 s deadline: a clear 504, not a hang
    for result in results.values():
        assert isinstance(result, openai.InternalServerError) and result.status_code == 504
        assert result.code == "timeout"
    assert guarded_server.metric("kvserve_requests_running", key) == 0
    assert guarded_server.metric("kvserve_requests_waiting", key) == 0


def test_sessions_through_the_sdk(client, server):
    messages = [{"role": "user", "content": "Describe a lighthouse."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, prompt_cache_key="sdk-conv")
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And at night?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_headers={"X-Session-ID": "sdk-conv"},
    )
    second = raw.parse()
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert raw.headers["x-cache-reused-tokens"] == str(second.usage.prompt_tokens_details.cached_tokens)
    fresh = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, prompt_cache_key="sdk-other")
    assert fresh.choices[0].message.content == second.choices[0].message.content
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvserve_prefix_cache_hits_tokens_total" in metrics and "kvserve_sessions_resident" in metrics
