"""Hardening reproducers that reach the engine, grammars and metrics, in-process on the real
model: each asserts the exact status, `code` and `param`, and that the server keeps serving."""

from __future__ import annotations

import asyncio
import math

import pytest

from cache_manager.manager import CacheConfig, CacheManager
from server.engine.core import Engine, EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from tests.server.test_api import HELLO, MODEL, assert_error_shape, sse_payloads

pytestmark = pytest.mark.anyio
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"], "additionalProperties": False}


def chat(**extra):
    return {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 8, **extra}


def schema(s):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


async def still_serving(client):
    response = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert response.status_code == 200, response.text


# -- 2: logprobs under a grammar are the model's own distribution -------------------------------


async def test_structured_logprobs_are_finite_model_logprobs(app_client):
    async with app_client() as client:
        body = chat(response_format=schema(PERSON), logprobs=True, top_logprobs=20, max_tokens=12)
        plain = await client.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        entries = plain.json()["choices"][0]["logprobs"]["content"]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert "Infinity" not in streamed.text and "NaN" not in streamed.text
        chunks = [c for c in sse_payloads(streamed.text) if c != "[DONE]" and c["choices"] and c["choices"][0]["logprobs"]]
        assert chunks
        for entry in entries:
            assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(tops) == 20 and all(math.isfinite(t) for t in tops)
            # the unmasked distribution: a grammar-forbidden token may rank above the chosen one
            assert tops == sorted(tops, reverse=True)


# -- 3: grammars that can never finish ---------------------------------------------------------

NEVER_COMPLETE = [
    ({"response_format": schema({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})}, "response_format"),
    ({"response_format": schema({"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]})}, "response_format"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_grammar": "start: a\na: a"}, "guided_grammar"),
    ({"response_format": schema({"type": "string", "pattern": "^a{1000000}$"})}, "response_format"),
]


@pytest.mark.parametrize("extra,param", NEVER_COMPLETE)
async def test_grammars_that_can_never_complete_are_400(app_client, extra, param):
    async with app_client() as client:
        error = assert_error_shape(await client.post("/v1/chat/completions", json=chat(**extra)), 400, "invalid_grammar", param)
        assert "no output can ever complete" in error["message"]
        await still_serving(client)


class _DeadEndGrammar:
    """A real compiled grammar whose matchers are driven into llguidance's error state."""

    def __init__(self, compiled, bad_token):
        self.compiled, self.bad_token = compiled, bad_token

    def new_matcher(self):
        matcher = self.compiled.new_matcher()
        assert not matcher.accept(self.bad_token)
        return matcher


def test_a_matcher_that_dead_ends_fails_the_request_not_stop(smollm2):
    from grammars import GrammarCompiler, spec_from_request

    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    compiled = compiler.compile(spec_from_request(None, None, guided_regex="[0-9]+"))
    letter = smollm2.tokenizer.convert_tokens_to_ids("x")
    cache = CacheManager(smollm2.model.config, smollm2.device, smollm2.dtype, smollm2.max_context, CacheConfig(budget_bytes=2**30))
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_context=smollm2.max_context), cache)
    engine.start()

    async def run(request):
        outputs = [o async for o in engine.submit(request, asyncio.get_running_loop())]
        return outputs[-1]

    async def go():
        prompt = smollm2.tokenizer("Pick a number:")["input_ids"]
        dead = GenerationRequest("dead", prompt, SamplingParams(max_tokens=8, temperature=0), grammar=_DeadEndGrammar(compiled, letter))
        fine = GenerationRequest("fine", prompt, SamplingParams(max_tokens=4, temperature=0), grammar=compiled)
        return await asyncio.gather(run(dead), run(fine))

    try:
        dead, fine = asyncio.run(go())
    finally:
        engine.stop()
    assert dead.finish_reason == "error" and dead.error == "grammar"
    assert fine.finish_reason in ("stop", "length") and fine.error is None


# -- 4: requests that can never fit --------------------------------------------------------------


async def test_requests_larger_than_the_queue_or_the_batch_are_400(app_client):
    async with app_client(max_queue=64, max_running=4) as client:
        too_many = {"model": MODEL, "prompt": ["one"] * 64, "n": 2, "max_tokens": 2}
        error = assert_error_shape(await client.post("/v1/completions", json=too_many), 400, "too_many_sequences", "n")
        assert "128 sequences" in error["message"] and "64" in error["message"] and "--max-queue" in error["message"]
        error = assert_error_shape(await client.post("/v1/chat/completions", json=chat(n=5)), 400, "too_many_sequences", "n")
        assert "--max-running" in error["message"] and "4" in error["message"]
        assert (await client.post("/v1/chat/completions", json=chat(n=4, max_tokens=2))).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'kvserve_request_rejections_total{reason="too_large"} 2.0' in metrics


# -- 10: every labelled series exists on a fresh server ----------------------------------------


async def test_fresh_server_exports_every_known_label(app_client):
    async with app_client() as client:
        text = (await client.get("/metrics")).text
    for series in (
        'kvserve_request_rejections_total{reason="queue_full"} 0.0',
        'kvserve_request_rejections_total{reason="kv_budget"} 0.0',
        'kvserve_session_evictions_total{reason="expired"} 0.0',
        'kvserve_structured_requests_total{kind="json_schema"} 0.0',
        'kvserve_structured_requests_total{kind="tool_call_auto"} 0.0',
        'kvserve_prefix_cache_misses_total{reason="not_croppable"} 0.0',
        'kvserve_request_finished_total{finish_reason="abort",route="/v1/completions"} 0.0',
    ):
        assert series in text, series


async def test_the_servers_own_400s_count_as_rejections(app_client):
    # NOTE: a KV budget always holds one sequence at the full context (the server refuses to
    # start otherwise: tests/server/test_kv_budget.py), so what can never fit is a request
    # longer than the context
    async with app_client(kv_budget_bytes=1_000_000, max_model_len=16) as client:  # one 16-token block
        empty = await client.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 2})
        assert_error_shape(empty, 400, "invalid_value", "prompt")
        assert_error_shape(await client.post("/v1/chat/completions", json=chat()), 400, "context_length_exceeded")
        text = (await client.get("/metrics")).text
    assert 'kvserve_request_rejections_total{reason="bad_request"} 1.0' in text
    assert 'kvserve_request_rejections_total{reason="too_long"} 1.0' in text
