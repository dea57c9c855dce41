"""Structured output over HTTP (in-process) on the real model: response_format, vLLM's
extensions, tool calls, validation before admission, streaming, n > 1, sessions, metrics."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tests.server.test_api import MODEL, assert_error_shape, sse_payloads

pytestmark = pytest.mark.anyio
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def schema_format(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def body(**extra):
    return {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, **extra}


async def test_json_schema_plain_streamed_and_n(app_client):
    async with app_client() as client:
        plain = (await client.post("/v1/chat/completions", json=body(response_format=schema_format()))).json()
        choice = plain["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        assert choice["message"]["content"].startswith('{"name":"')  # compact: no whitespace runs

        streamed = await client.post("/v1/chat/completions", json=body(response_format=schema_format(), stream=True))
        chunks = [c for c in sse_payloads(streamed.text) if c != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == choice["message"]["content"]

        several = (await client.post("/v1/chat/completions", json=body(response_format=schema_format(), n=2, temperature=1.0, seed=3))).json()
        for c in several["choices"]:
            if c["finish_reason"] == "stop":
                jsonschema.validate(json.loads(c["message"]["content"]), PERSON)


async def test_truncation_is_length_and_stop_strings_cannot_break_json(app_client):
    async with app_client() as client:
        short = (await client.post("/v1/chat/completions", json=body(response_format=schema_format(), max_tokens=3))).json()
        assert short["choices"][0]["finish_reason"] == "length"
        stopped = (await client.post("/v1/chat/completions", json=body(response_format=schema_format(), stop=['"age"']))).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(stopped["choices"][0]["message"]["content"]), PERSON)


async def test_json_object_and_vllm_extensions(app_client):
    async with app_client() as client:
        obj = (await client.post("/v1/chat/completions", json=body(response_format={"type": "json_object"}, max_tokens=200))).json()
        if obj["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
        else:
            assert obj["choices"][0]["message"]["content"].startswith("{")
        text = (await client.post("/v1/chat/completions", json=body(response_format={"type": "text"}, max_tokens=5))).json()
        assert text["choices"][0]["finish_reason"] in ("stop", "length")

        cases = [
            ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
            ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
            ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", t)),
            ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
            ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}},
             lambda t: isinstance(json.loads(t)["ok"], bool)),
            ({"structured_outputs": {"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'}}, lambda t: re.fullmatch(r"The answer is [0-9]+\.", t)),
            ({"guided_grammar": 'root ::= "ok" | "not ok"'}, lambda t: t in ("ok", "not ok")),
        ]
        for extra, check in cases:
            out = (await client.post("/v1/chat/completions", json=body(**extra, max_tokens=30))).json()
            assert out["choices"][0]["finish_reason"] == "stop", (extra, out)
            assert check(out["choices"][0]["message"]["content"]), (extra, out["choices"][0]["message"]["content"])
        # completions take the same extensions
        out = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "Colour:", "guided_choice": ["red", "blue"], "temperature": 0})).json()
        assert out["choices"][0]["text"] in ("red", "blue")


@pytest.mark.parametrize(
    "response_format, fragment",
    [
        (schema_format({"type": "string", "pattern": "(("}), "regex"),
        (schema_format({"type": "integer", "minimum": 5, "maximum": 1}), ""),
        (schema_format({"$ref": "https://example.com/schema.json"}), "$ref"),
        (schema_format({"type": "strnig"}), ""),
        (schema_format({"not": {"type": "string"}}), "not"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}, ""),
        ({"type": "yaml"}, ""),
        (schema_format({"type": "string", "format": "semver"}), "format"),
    ],
)
async def test_invalid_schemas_are_400_before_admission(app_client, response_format, fragment):
    async with app_client() as client:
        response = await client.post("/v1/chat/completions", json=body(response_format=response_format))
        error = assert_error_shape(response, 400, param="response_format")
        assert "\n" not in error["message"] and len(error["message"]) <= 300
        assert fragment in error["message"]
        metrics = (await client.get("/metrics")).text
        assert 'kvserve_request_rejections_total{reason="bad_schema"} 1.0' in metrics
        assert "kvserve_requests_waiting 0.0" in metrics


async def test_conflicting_grammar_fields_and_tool_choice_errors(app_client):
    async with app_client() as client:
        both = body(response_format=schema_format(), guided_regex="a+")
        assert_error_shape(await client.post("/v1/chat/completions", json=both), 400)
        bad_regex = body(structured_outputs={"regex": "(("})
        assert_error_shape(await client.post("/v1/chat/completions", json=bad_regex), 400, param="structured_outputs")
        unknown_tool = body(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
        assert_error_shape(await client.post("/v1/chat/completions", json=unknown_tool), 400, param="tool_choice")
        no_tools = body(tool_choice="required")
        assert_error_shape(await client.post("/v1/chat/completions", json=no_tools), 400, param="tool_choice")


async def test_characters_no_token_can_write_are_a_400_not_a_500(app_client):
    """SmolLM2's vocabulary has no token holding byte 0x06 (schemathesis found this): a choice
    with it is refused before admission; a regex that needs it after a free choice (not checked
    up front: llguidance's mask then lets the model past the byte, and its parser refuses what
    follows) ends as a 400 dead end, not an internal error, and the server serves the next
    request."""
    async with app_client() as client:
        choice = {"model": MODEL, "prompt": "Pick:", "guided_choice": ["ok", "V\x06\r"], "max_tokens": 4}
        error = assert_error_shape(await client.post("/v1/completions", json=choice), 400, param="guided_choice")
        assert "guided_choice[1]" in error["message"] and "\\x06" in error["message"]
        # the bias makes the model take the V branch (token 70); past "V" only 0x06 may follow;
        # with logprobs nothing is fast-forwarded: the model samples under the mask
        regex = {"model": MODEL, "prompt": "Pick:", "guided_regex": "ab|V\x06x", "max_tokens": 4, "temperature": 0, "logit_bias": {"70": 100}, "logprobs": 1}
        error = assert_error_shape(await client.post("/v1/completions", json=regex), 400)
        assert error["code"] == "grammar_dead_end"
        fine = {"model": MODEL, "prompt": "Pick:", "guided_choice": ["a\rb", "caf\u00e9"], "max_tokens": 4}
        out = (await client.post("/v1/completions", json=fine)).json()
        assert out["choices"][0]["text"] in ("a\rb", "caf\u00e9")


async def test_pathological_schema_rejected_in_time_while_others_flow(app_client):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}
    async with app_client(grammar_compile_timeout_s=0.3) as client:
        slow = asyncio.create_task(client.post("/v1/chat/completions", json=body(response_format=schema_format(huge))))
        normal = await client.post("/v1/chat/completions", json=body(max_tokens=3))
        assert normal.status_code == 200
        error = assert_error_shape(await slow, 400, param="response_format")
        assert "time limit" in error["message"]
        assert (await client.post("/v1/chat/completions", json=body(response_format=schema_format()))).status_code == 200


async def test_forced_tool_calls(app_client):
    async with app_client() as client:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            out = (await client.post("/v1/chat/completions", json=body(
                messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER_TOOL], tool_choice=choice,
                parallel_tool_calls=False,  # several calls: tests/e2e/test_tool_calls_sdk.py
            ))).json()
            c = out["choices"][0]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            call = c["message"]["tool_calls"][0]
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])
        plain = (await client.post("/v1/chat/completions", json=body(tools=[WEATHER_TOOL], tool_choice="none", max_tokens=5))).json()
        assert plain["choices"][0]["message"]["content"] and "tool_calls" not in plain["choices"][0]["message"]
        streamed = await client.post("/v1/chat/completions", json=body(tools=[WEATHER_TOOL], tool_choice="required", stream=True, parallel_tool_calls=False))
        chunks = [c for c in sse_payloads(streamed.text) if c != "[DONE]"]
        calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
        heads = [call for call in calls if "id" in call]  # each call: id and name first, then its arguments
        assert heads and heads[0]["function"]["name"] == "get_weather" and calls[0] is heads[0]
        first = "".join(call["function"]["arguments"] for call in calls if call["index"] == 0)
        jsonschema.validate(json.loads(first), WEATHER_TOOL["function"]["parameters"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_grammar_with_sessions_and_metrics(app_client):
    async with app_client() as client:
        messages = list(ASK)
        first = (await client.post("/v1/chat/completions", json=body(messages=messages, response_format=schema_format(), prompt_cache_key="so"))).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, {"role": "user", "content": "Another one."}]
        second = (await client.post("/v1/chat/completions", json=body(messages=messages, response_format=schema_format(), prompt_cache_key="so"))).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"] - 2
        assert second["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(second["choices"][0]["message"]["content"]), PERSON)  # no state leaked
        # the same session without a grammar is free text again
        messages += [{"role": "assistant", "content": second["choices"][0]["message"]["content"]}, {"role": "user", "content": "Say hi."}]
        free = (await client.post("/v1/chat/completions", json=body(messages=messages, prompt_cache_key="so", max_tokens=5))).json()
        assert free["choices"][0]["finish_reason"] in ("stop", "length")
        metrics = (await client.get("/metrics")).text
        assert 'kvserve_structured_requests_total{kind="json_schema"} 2.0' in metrics
        assert "kvserve_grammar_cache_hits_total 1.0" in metrics
        assert "kvserve_grammar_compile_seconds_count" in metrics
        count = [line for line in metrics.splitlines() if line.startswith("kvserve_grammar_mask_seconds_count")]
        assert float(count[0].split()[-1]) > 10


async def test_auto_tool_choice_text_or_triggered_call(app_client):
    async with app_client() as client:
        # the first token decides; steer it with logit_bias to get each branch deterministically
        open_id = "44"  # "<" in SmolLM2's vocabulary (checked below)
        call = (await client.post("/v1/chat/completions", json=body(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER_TOOL],
            logit_bias={open_id: 30}, max_tokens=60, parallel_tool_calls=False,  # the bias would start call after call
        ))).json()
        c = call["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        args = json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
        text = (await client.post("/v1/chat/completions", json=body(
            messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER_TOOL], logit_bias={open_id: -100}, max_tokens=8,
        ))).json()
        assert text["choices"][0]["finish_reason"] in ("stop", "length")
        assert not text["choices"][0]["message"]["content"].startswith("<")
        streamed = await client.post("/v1/chat/completions", json=body(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER_TOOL],
            logit_bias={open_id: 30}, max_tokens=60, stream=True, parallel_tool_calls=False,
        ))
        chunks = [c for c in sse_payloads(streamed.text) if c != "[DONE]"]
        assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
        assert [c for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_open_bracket_token_id(tokenizer):
    assert tokenizer.decode([44]) == "<"
