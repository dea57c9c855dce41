"""Bounded work per request (issue 37): a body far longer than the context is refused fast and names
its field, a request's total work (prompts x n x max_tokens x logprob entries) has one bound, the
fields that are compiled or rendered have size bounds, and the grammar cache is bounded in bytes.
Real app, real SmolLM2 (context 8192, so the default work bound is 65536)."""

from __future__ import annotations

import json
import random
import string
import time

import pytest

from grammars import GrammarCompiler, GrammarSpec
from grammars.compile import GRAMMAR_BASE_BYTES, GRAMMAR_BYTES_PER_BYTE
from server.api import limits
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest
from server.metrics import Metrics
from tests.inprocess import openai_client
from tests.server.test_api import HELLO, MODEL, assert_error_shape, sample

pytestmark = pytest.mark.anyio
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
VOCAB_SIZE = 49152
# NOTE: before the early stop, a 3 MB body cost 2-7 s of tokenizing (this text is the slowest
# kind) on a 2-core box before its 400; now about 0.1 s.
REFUSED_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def client(smollm2):
    """One app with the default settings for the tests that only send requests to it."""
    async with openai_client(smollm2) as (_, http):
        yield http


def three_megabytes() -> str:
    """3 MB of random printable text: the slowest text to tokenize (about one token a byte)."""
    rng = random.Random(37)
    return "".join(rng.choices(string.ascii_letters + string.digits + string.punctuation + " ", k=3_000_000))


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def responses(**fields) -> dict:
    return {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False, **fields}


# -- a body far longer than the context ----------------------------------------------------------


async def test_a_3mb_body_is_refused_fast_naming_the_long_field(client):
    text = three_megabytes()
    bodies = {
        CHAT: ({"model": MODEL, "messages": [{"role": "user", "content": text}]}, "messages"),
        COMPLETIONS: ({"model": MODEL, "prompt": text}, "prompt"),
        RESPONSES: ({"model": MODEL, "input": text}, "input"),
    }
    for path, (body, param) in bodies.items():
        started = time.monotonic()
        response = await client.post(path, json=body)
        elapsed = time.monotonic() - started
        error = assert_error_shape(response, 400, "context_length_exceeded", param)
        assert "8192" in error["message"], error
        assert elapsed < REFUSED_WITHIN_S, f"{path}: {elapsed:.2f} s"
    # a list of prompts stops at the first that is too long
    response = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": ["Hi", text[:1_000_000], text[1_000_000:2_000_000]]})
    assert_error_shape(response, 400, "context_length_exceeded", "prompt")


async def test_a_prompt_that_fits_keeps_its_exact_tokens(client, tokenizer):
    """Whitespace runs (64 spaces a token) make a text longer than 4 characters per context
    token that fits: it goes through the prefix checks, then is tokenized whole, as before."""
    prompt = "Hello" + " " * 64 * 600 + "world"
    response = await client.post(COMPLETIONS, json=completion(prompt=prompt, max_tokens=1))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])


def test_prompt_ids_are_the_tokenizers_for_texts_that_fit(tokenizer):
    texts = ["word " * 1000, " " * 64 * 1000, "x" + "\n" * 3000, "日本語のテキスト" * 500]
    for text in texts:
        assert limits.prompt_ids(tokenizer, text, 8192, "prompt") == tokenizer(text)["input_ids"]
    with pytest.raises(APIError) as refused:
        limits.prompt_ids(tokenizer, "word " * 50_000, 1000, "messages", add_special_tokens=False)
    assert (refused.value.param, refused.value.code, refused.value.status) == ("messages", "context_length_exceeded", 400)


# -- total work per request ----------------------------------------------------------------------


WORK_CASES = {
    "n_times_max_tokens": (CHAT, chat(n=16, max_tokens=5000), "n"),
    "max_completion_tokens_named": (CHAT, chat(n=16, max_tokens=None, max_completion_tokens=5000), "n"),
    "top_logprobs_count": (CHAT, chat(logprobs=True, top_logprobs=20, max_tokens=4000), "top_logprobs"),
    "completions_logprobs_count": (COMPLETIONS, completion(logprobs=20, max_tokens=4000), "logprobs"),
    "completions_n": (COMPLETIONS, completion(n=16, max_tokens=5000), "n"),
    "prompt_lists_count": (COMPLETIONS, completion(prompt=["Hi"] * 9, max_tokens=8000), "prompt"),
}


async def test_total_work_is_bounded_naming_the_field_to_lower(client):
    before = too_large(await client.get("/metrics"))
    for name, (path, body, param) in WORK_CASES.items():
        error = assert_error_shape(await client.post(path, json=body), 400, "request_too_large", param)
        assert "65536" in error["message"] and "--max-request-tokens" in error["message"], (name, error)
    fits = await client.post(CHAT, json=chat(n=4, logprobs=True, top_logprobs=5, max_tokens=2))
    assert fits.status_code == 200, fits.text
    assert too_large(await client.get("/metrics")) == before + len(WORK_CASES)


def too_large(metrics) -> float:
    return sample(metrics.text, 'kvserve_request_rejections_total{reason="too_large"}')


async def test_an_unset_max_tokens_is_lowered_to_fit_not_refused(app_client):
    """Context 64: the bound is 512; 4 choices x 21 logprob entries leave 6 tokens each."""
    async with app_client(max_model_len=64) as client:
        body = chat(n=4, logprobs=True, top_logprobs=20, max_tokens=None, logit_bias={"2": -100})
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4 * (512 // (4 * 21))


async def test_the_setting_bounds_every_route(app_client):
    async with app_client(max_request_tokens=1) as client:
        cases = [(CHAT, chat(max_tokens=2), "max_tokens"), (COMPLETIONS, completion(max_tokens=2), "max_tokens"),
                 (RESPONSES, responses(max_output_tokens=2), "max_output_tokens")]
        for path, body, param in cases:
            assert_error_shape(await client.post(path, json=body), 400, "request_too_large", param)
        assert (await client.post(CHAT, json=chat(max_tokens=1))).status_code == 200


def test_work_names_the_first_field_whose_minimum_fits():
    """Top logprobs, then n, then prompts: the first whose minimum alone fits; else max_tokens."""
    assert limits.work_limit(None, 8192) == 65536 and limits.work_limit(10, 8192) == 10
    limits.Work(2, 4, 3).check(2 * 4 * 4 * 100, 100)  # exactly at the bound
    cases = [(limits.Work(2, 4, 3), 3199, "top_logprobs"), (limits.Work(2, 4, 0), 799, "n"),
             (limits.Work(2, 1, 0), 199, "prompt"), (limits.Work(1, 1, 0), 99, "max_tokens"),
             (limits.Work(2, 4, 3), 500, "max_tokens")]
    for work, limit, param in cases:
        with pytest.raises(APIError) as refused:
            work.check(limit, 100)
        assert (refused.value.param, refused.value.code) == (param, "request_too_large"), work
    assert limits.Work(1, 4, 20).default_max_tokens(512, 34) == 6
    assert limits.Work(64, 16, 20).default_max_tokens(512, 34) == 1  # then check refuses it


# -- sizes of what is compiled or rendered --------------------------------------------------------


def big_schema(nbytes: int) -> dict:
    return {"type": "string", "enum": [f"value-{i:07d}" for i in range(nbytes // 16)]}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(name: str = "f", parameters: dict | None = None, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters or {"type": "object"}}}


SIZE_CASES = {
    "129_tools": (CHAT, chat(tools=[tool(f"f{i}") for i in range(129)]), "tools", "at most 128"),
    "tools_over_512_KiB": (CHAT, chat(tools=[tool(description="d" * 600_000)]), "tools", "at most 524288"),
    "responses_tools_over_512_KiB": (
        RESPONSES, responses(tools=[{"type": "function", "name": "f", "description": "d" * 600_000}]), "tools", "at most 524288"),
    "tool_schema_nested_200_deep": (CHAT, chat(tools=[tool(parameters=nested_schema(200))]), "tools", "deeper than 128"),
    "response_format_over_256_KiB": (
        CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": big_schema(300_000)}}),
        "response_format", "at most 262144"),
    "responses_text_format_over_256_KiB": (
        RESPONSES, responses(text={"format": {"type": "json_schema", "name": "x", "schema": big_schema(300_000)}}),
        "text.format.schema", "at most 262144"),
    "response_format_nested_200_deep": (
        CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(200)}}),
        "response_format", "recursion limit"),
    "guided_json": (COMPLETIONS, completion(guided_json=big_schema(300_000)), "guided_json", "at most 262144"),
    "guided_regex": (CHAT, chat(guided_regex="a" * 300_000), "guided_regex", "at most 262144"),
    "guided_choice": (CHAT, chat(guided_choice=["c" * 1000] * 300), "guided_choice", "at most 262144"),
    "guided_grammar": (COMPLETIONS, completion(guided_grammar='start: "' + "a" * 300_000 + '"'), "guided_grammar", "at most 262144"),
    "structured_outputs": (CHAT, chat(structured_outputs={"regex": "a" * 300_000}), "structured_outputs", "at most 262144"),
    "stop_string_over_1024": (CHAT, chat(stop=["s" * 1025]), "stop[0]", "at most 1024"),
    "chat_template_kwargs_over_1_KiB": (
        CHAT, chat(chat_template_kwargs={"enable_thinking": True, "padding": "p" * 2000}), "chat_template_kwargs", "at most 1024"),
}
# NOTE: deeper than this test's own json.dumps goes on top of pytest's stack: written by hand.
DEEP_KWARGS = json.dumps(chat()).removesuffix("}").encode() + b', "chat_template_kwargs": ' + b'{"a":' * 900 + b"1" + b"}" * 901


async def test_compiled_and_rendered_fields_are_size_bounded(client):
    for name, (path, body, param, words) in SIZE_CASES.items():
        response = await client.post(path, json=body)
        error = assert_error_shape(response, 400, param=param)
        assert words in error["message"], (name, error)
    deep = await client.post(CHAT, content=DEEP_KWARGS, headers={"content-type": "application/json"})
    assert "at most 1024" in assert_error_shape(deep, 400, param="chat_template_kwargs")["message"]
    ChatCompletionRequest.model_validate(chat(tools=[tool(f"f{i}", description="d" * 4000) for i in range(128)]))  # at the bounds


# -- the grammar cache, bounded in bytes ----------------------------------------------------------


def test_grammar_cache_is_bounded_in_bytes_least_recent_first(tokenizer):
    """Three 4-byte regexes fill the bound exactly; the order of eviction is least recently used."""
    small = GRAMMAR_BASE_BYTES + 4 * GRAMMAR_BYTES_PER_BYTE
    c = GrammarCompiler(tokenizer, VOCAB_SIZE, cache_bytes=3 * small)
    s1, s2, s3, s4 = (GrammarSpec("regex", f"a{{{i}}}") for i in range(1, 5))
    medium, huge = GrammarSpec("regex", "b" * 512), GrammarSpec("regex", "c" * 4000)
    for spec in (s1, s2, s3):
        c.compile(spec)
    assert (len(c), c.nbytes, c.evictions) == (3, 3 * small, 0)
    c.compile(s1)  # a hit: s2 is now the least recently used
    c.compile(s4)
    assert (len(c), c.evictions) == (3, 1)
    c.compile(medium)  # evicts s3, then s1
    assert (len(c), c.nbytes, c.evictions) == (2, small + GRAMMAR_BASE_BYTES + 512 * GRAMMAR_BYTES_PER_BYTE, 3)
    c.compile(huge)  # larger than the bound alone: used, not kept
    assert (len(c), c.evictions) == (2, 3)
    misses = c.misses
    c.compile(s4)
    c.compile(medium)
    assert c.misses == misses
    for spec in (huge, s3, s2, s1):
        c.compile(spec)
        assert c.misses == misses + 1, spec
        misses += 1

    metrics = Metrics()
    metrics.watch_grammar_cache(c)
    text = metrics.render().decode()
    assert f"kvserve_grammar_cache_evictions_total {float(c.evictions)}" in text
    assert f"kvserve_grammar_cache_bytes {float(c.nbytes)}" in text
