"""Anthropic's Messages API (issue 50), in-process on the real model with the official `anthropic`
SDK: a turn answers what the same chat request answers (greedy), streamed or not; tool round
trips; a thinking model's signed thinking blocks; stop sequences; sessions and reuse reported as
cache reads; count_tokens; bad bodies as 4xx in Anthropic's error shape. A real server process:
tests/e2e/test_messages_sdk.py."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests import thinking
from tests.inprocess import anthropic_client
from tests.server.test_api import MODEL

pytestmark = pytest.mark.anyio
KEY = "sk-messages"
SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}
AUTH = {"x-api-key": KEY}
GREEDY = {"temperature": 0}  # the current SDK no longer has sampling arguments; older clients send them


def assert_anthropic_error(response, status: int, kind: str | None = None, says: str | None = None) -> dict:
    """A non-2xx in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    assert "Traceback" not in response.text and "/site-packages/" not in response.text
    if kind is not None:
        assert body["error"]["type"] == kind, body
    if says is not None:
        assert says in body["error"]["message"], body
    return body["error"]


def events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a Messages stream."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


@pytest.fixture
def serve(smollm2):
    return lambda **settings: anthropic_client(smollm2, api_key=[KEY], **settings)


async def test_a_turn_answers_what_chat_answers_streamed_or_not(serve):
    """Greedy: the message's text is the chat completion's for the same conversation; the
    stream's events come in Anthropic's order and add up to the same message; usage counts the
    chat's prompt tokens (cache reads and the rest)."""
    async with serve() as (client, http):
        chat = (await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *ASK], "max_tokens": 12, "temperature": 0})).json()
        whole = await client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
        assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL and whole.id.startswith("msg_")
        assert [b.type for b in whole.content] == ["text"]
        assert whole.content[0].text == chat["choices"][0]["message"]["content"]
        assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
        usage = whole.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
        assert usage.cache_creation_input_tokens == 0
        assert usage.output_tokens == chat["usage"]["completion_tokens"]

        async with client.messages.stream(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
            async for _ in stream:
                pass
            streamed = await stream.get_final_message()
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
        assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)

        raw = await http.post("/v1/messages", headers=AUTH | {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-05-16"},
                              json={"model": MODEL, "system": [{"type": "text", "text": SYSTEM}], "messages": ASK, "max_tokens": 12,
                                    "temperature": 0, "stream": True})
        names = [name for name, _ in events(raw.text)]
        assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[3:-3]) == {"content_block_delta"}
        assert raw.headers["request-id"].startswith("msg_") and raw.headers["x-cache-reused-tokens"]


async def test_a_tool_round_trip_streamed_and_not(serve):
    """`any` forces a call: a tool_use block with a parsed input valid against its schema, the
    same streamed (input_json_delta); its result sent back continues the conversation, which
    reuses the earlier turn's KV (anonymous reuse: whole blocks of it); a named tool is the one called; `none` answers in text."""
    async with serve() as (client, http):
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        functions = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
                     for t in (WEATHER, TIME)]
        chat = (await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": MODEL, "messages": asked, "tools": functions, "tool_choice": "required", "max_tokens": 60, "temperature": 0})).json()
        turn = await client.messages.create(model=MODEL, messages=asked, tools=[WEATHER, TIME], tool_choice={"type": "any"},
                                            max_tokens=60, extra_body=GREEDY)
        assert turn.stop_reason == "tool_use"
        calls = [b for b in turn.content if b.type == "tool_use"]
        assert calls and calls[0].name in ("get_weather", "get_time")
        jsonschema.validate(calls[0].input, WEATHER["input_schema"])
        # the turn is the chat turn: the same prompt (the chat's KV, reused to its last whole block) and calls
        prompt = turn.usage.input_tokens + turn.usage.cache_read_input_tokens
        assert prompt == chat["usage"]["prompt_tokens"] and turn.usage.cache_read_input_tokens > prompt - 32
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in chat["choices"][0]["message"]["tool_calls"]] \
            == [(c.name, c.input) for c in calls]

        async with client.messages.stream(model=MODEL, messages=asked, tools=[WEATHER, TIME], tool_choice={"type": "any"},
                                          max_tokens=60, extra_body=GREEDY) as stream:
            deltas = [e.delta.partial_json async for e in stream if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
            streamed = await stream.get_final_message()
        assert deltas and [b.input for b in streamed.content] == [b.input for b in turn.content]

        results = [{"type": "tool_result", "tool_use_id": c.id, "content": [{"type": "text", "text": "Sunny, 21 C"}]} for c in calls]
        follow = await client.messages.create(model=MODEL, messages=[*asked, {"role": "assistant", "content": turn.content},
                                                                     {"role": "user", "content": results}],
                                              tools=[WEATHER, TIME], max_tokens=8, extra_body=GREEDY)
        assert follow.usage.cache_read_input_tokens > (turn.usage.input_tokens + turn.usage.cache_read_input_tokens) // 2  # whole blocks of it

        named = await client.messages.create(model=MODEL, messages=asked, tools=[WEATHER, TIME], max_tokens=60, extra_body=GREEDY,
                                             tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
        assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
        none = await client.messages.create(model=MODEL, messages=asked, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8, extra_body=GREEDY)
        assert [b.type for b in none.content] == ["text"] and none.stop_reason != "tool_use"


async def test_stop_sequences_and_prefill(serve):
    async with serve() as (client, _):
        free = await client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY)
        words = free.content[0].text.split()
        stop = words[2]
        cut = await client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY, stop_sequences=["zzzz", stop])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert cut.content[0].text == free.content[0].text[: free.content[0].text.index(stop)]
        prefix = " ".join(words[:2])  # Anthropic's prefill: the answer continues the assistant's text
        went_on = await client.messages.create(model=MODEL, messages=[*ASK, {"role": "assistant", "content": prefix}], max_tokens=6, extra_body=GREEDY)
        assert (prefix + went_on.content[0].text).startswith(" ".join(words[:3])[: len(prefix) + 2])


async def test_sessions_count_tokens_and_dropped_server_tools(serve):
    """A session named by `metadata.session_id` or X-Session-ID is continued (cache reads);
    count_tokens counts what create prefills; server tools are dropped and named."""
    async with serve() as (client, http):
        first = await client.messages.create(model=MODEL, messages=ASK, max_tokens=6, extra_body=GREEDY, metadata={"session_id": "conv-1"})
        history = [*ASK, {"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And two more?"}]
        raw = await client.messages.with_raw_response.create(model=MODEL, messages=history, max_tokens=6, extra_body=GREEDY,
                                                             extra_headers={"X-Session-ID": "conv-1"})
        second = await raw.parse()
        assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
        sessions = (await http.get("/v1/sessions", headers=AUTH)).json()
        assert "conv-1" in json.dumps(sessions)

        for tools in (None, [WEATHER]):
            extra = {"tools": tools} if tools else {}
            counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history, **extra)
            made = await client.messages.create(model=MODEL, system=SYSTEM, messages=history, max_tokens=1, **extra)
            assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens

        server_tools = [WEATHER, {"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"}]
        dropped = await client.messages.with_raw_response.create(model=MODEL, messages=ASK, tools=server_tools, max_tokens=2)
        assert dropped.headers["x-kvserve-dropped-tools"] == "web_search_20250305, bash_20250124"


async def test_bad_bodies_are_4xx_in_anthropics_shape(serve):
    async with serve() as (client, http):
        good = {"model": MODEL, "max_tokens": 4, "messages": ASK}
        cases = [
            ({k: v for k, v in good.items() if k != "max_tokens"}, 400, "max_tokens"),
            (good | {"messages": []}, 400, "messages"),
            (good | {"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
            (good | {"messages": [{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, 400, "system"),
            (good | {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "content block"),
            (good | {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "tool_use"),
            (good | {"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, 400, "tool_result"),
            (good | {"thinking": {"type": "enabled"}}, 400, "budget_tokens"),
            (good | {"thinking": {"type": "enabled", "budget_tokens": 4}}, 400, "less than max_tokens"),
            (good | {"temperature": 1.5}, 400, "temperature"),
            (good | {"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400, "name"),
            (good | {"tools": [{"name": "f"}]}, 400, "input_schema"),
            (good | {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400, "nope"),
            (good | {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                                            "data": "aGVsbG8="}}]}]}, 400, "image"),
            (good | {"messages": [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "made up", "signature": "AAAA"}]},
                                  {"role": "user", "content": "go on"}]}, 400, "signature"),
            (good | {"model": "claude-sonnet-4-5"}, 404, "claude-sonnet-4-5"),
        ]
        for body, status, says in cases:
            assert_anthropic_error(await http.post("/v1/messages", headers=AUTH, json=body), status, None, says)
        assert_anthropic_error(await http.post("/v1/messages", headers=AUTH, content=b"{not json", ), 400, "invalid_request_error")
        assert_anthropic_error(await http.post("/v1/messages", headers=AUTH, json=[1]), 400, "invalid_request_error")
        assert_anthropic_error(await http.post("/v1/messages/count_tokens", headers=AUTH, json={"model": MODEL}), 400, "invalid_request_error", "messages")
        for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}):
            assert_anthropic_error(await http.post("/v1/messages", headers=headers, json=good), 401, "authentication_error")
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-haiku", messages=ASK, max_tokens=2)
        assert (await client.messages.create(**good)).content  # still serving


@pytest.fixture(scope="module")
def deepseek_r1(tokenizer):
    """A tiny thinking model whose template opens the thinking in the prompt."""
    return thinking.tiny_model(thinking.family_tokenizer(tokenizer, "deepseek_r1"))


async def test_thinking_blocks_are_signed_streamed_and_accepted_back(deepseek_r1):
    """A thinking model with `thinking` enabled: a thinking block (the budget's tokens) with a
    signature, then the answer; streamed as thinking_delta, signature_delta, text_delta; sent
    back unchanged it is accepted, altered it is a 400; `disabled` makes no thinking block."""
    async with anthropic_client(deepseek_r1) as (client, http):
        ask = dict(model="tiny-deepseek_r1", messages=ASK, max_tokens=16, extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 4})
        whole = await client.messages.create(**ask)
        assert [b.type for b in whole.content][:2] == ["thinking", "text"]
        think = whole.content[0]
        assert think.thinking and think.signature and "<think>" not in think.thinking + whole.content[1].text
        async with client.messages.stream(**ask) as stream:
            kinds = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            streamed = await stream.get_final_message()
        assert kinds.index("signature_delta") > kinds.index("thinking_delta") and "text_delta" in kinds[kinds.index("signature_delta"):]
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]

        history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in whole.content]}, {"role": "user", "content": "Why?"}]
        assert (await client.messages.create(**ask | {"messages": history})).content
        altered = [*ASK, {"role": "assistant", "content": [{**think.model_dump(), "thinking": think.thinking + " (edited)"}]},
                   {"role": "user", "content": "Why?"}]
        refused = await http.post("/v1/messages", json=ask | {"messages": altered})
        assert_anthropic_error(refused, 400, "invalid_request_error", "messages[1].content[0].signature")

        off = await client.messages.create(**ask | {"thinking": {"type": "disabled"}})
        assert [b.type for b in off.content] == ["text"]
        omitted = await client.messages.create(**ask | {"thinking": {"type": "adaptive", "display": "omitted"}})
        assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == "" and omitted.content[0].signature
