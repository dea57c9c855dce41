"""Tool calling as agent frameworks use it, end to end: a real server, the real SmolLM2, the
official openai SDK. Several calls in one response (plain and streamed), one call when
parallel_tool_calls is false, a call cut off by max_tokens, a round trip of several results,
and logprob bytes of a partial UTF-8 token."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": CITY}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo? Call both tools."}]
GREEDY = {"model": MODEL, "temperature": 0, "tools": TOOLS}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def check_calls(calls) -> None:
    """Every call valid against its tool's schema, ids unique."""
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_several_calls_in_one_response_plain_and_streamed(client):
    out = client.chat.completions.create(**GREEDY, messages=ASK, tool_choice="required", max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    check_calls(calls)

    stream = client.chat.completions.create(**GREEDY, messages=ASK, tool_choice="required", max_tokens=80, stream=True)
    heads, arguments, finish = [], {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: its id and name, before its arguments
                assert call.index not in arguments
                heads.append((call.index, call.id, call.function.name))
                arguments[call.index] = ""
            arguments[call.index] += call.function.arguments or ""
        finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert finish == ["tool_calls"]
    assert [i for i, _, _ in heads] == [0, 1] and heads[0][1] != heads[1][1]
    assert [(name, arguments[i]) for i, _, name in heads] == [(c.function.name, c.function.arguments) for c in calls]


def test_parallel_tool_calls_false_gives_one_call(client):
    for choice in ("required", "auto"):
        out = client.chat.completions.create(
            **GREEDY, messages=ASK, tool_choice=choice, parallel_tool_calls=False, max_tokens=80,
            logit_bias={"44": 30} if choice == "auto" else None)  # "<": the model calls under auto
        assert out.choices[0].finish_reason == "tool_calls"
        assert len(out.choices[0].message.tool_calls) == 1
        check_calls(out.choices[0].message.tool_calls)


def test_a_call_cut_off_by_max_tokens_is_a_partial_tool_call(client):
    full = client.chat.completions.create(**GREEDY, messages=ASK, tool_choice="required", max_tokens=80)
    arguments = full.choices[0].message.tool_calls[0].function.arguments
    partial = None
    for max_tokens in range(4, 20):  # from inside the wrapper to inside the first call's arguments
        out = client.chat.completions.create(**GREEDY, messages=ASK, tool_choice="required", max_tokens=max_tokens)
        choice = out.choices[0]
        assert choice.finish_reason == "length"
        assert "<tool" not in (choice.message.content or "")  # never the wrapper as text
        if choice.message.tool_calls:
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and arguments.startswith(call.function.arguments)
            if call.function.arguments.startswith('{"') and call.function.arguments != arguments:
                partial = call.function.arguments
                break
    assert partial is not None, "no max_tokens cut the call inside its arguments"


def test_several_results_round_trip(client):
    first = client.chat.completions.create(**GREEDY, messages=ASK, tool_choice="required", max_tokens=80)
    calls = first.choices[0].message.tool_calls
    assert len(calls) == 2
    answers = {"get_weather": "18 C and sunny", "get_time": "10:42"}
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": answers[c.function.name]} for c in calls),
    ]
    reply = client.chat.completions.create(**GREEDY, messages=messages, max_tokens=20, logit_bias={"44": -100})
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    # the prompt held both calls and both results: it is longer than the one without results
    shorter = client.chat.completions.create(**GREEDY, messages=messages[:-1], max_tokens=1)
    assert reply.usage.prompt_tokens > shorter.usage.prompt_tokens + 3


def test_logprob_bytes_are_the_tokens_own(client):
    # token 173 is the lone byte 0xE2 (the first byte of a 3-byte character): its text is U+FFFD
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, logprobs=True, top_logprobs=1,
        logit_bias={"173": 100})
    entry = out.choices[0].logprobs.content[0]
    assert entry.token == "\ufffd" and entry.bytes == [0xE2]
