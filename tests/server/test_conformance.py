"""Issue 53 item 4: every chat chunk, completion, Responses event and Messages event kvserve sends,
streamed and not, parsed strictly by the official SDKs' typed models with each stream's sequence
rules (tests/conformance.py); on SmolLM2, on a tiny thinking model (reasoning, thinking blocks,
reasoning summaries) and on streams cut by an error. Then the checks themselves, on hand-mutated
payloads, so a rule that can never fail would show here; and the `Recorder` middleware."""

from __future__ import annotations

import contextlib
import copy
import json

import httpx
import pytest

from tests import conformance, thinking
from tests.inprocess import served
from tests.server.test_api import MODEL

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "Say hello."}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}
FUNCTION = {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS}
# one call, forced: its wrapper and name count as tokens (the grammar writes them, with no forward pass)
CALL_TOKENS = 32
CHAT_CALL = {"tools": [{"type": "function", "function": FUNCTION}], "tool_choice": "required", "parallel_tool_calls": False}
# a reply that cannot complete within request_timeout_s on any machine: the stream ends in an error
NUMBERS = {"type": "object", "required": ["n"], "properties": {"n": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}}


def payloads(response: httpx.Response) -> list:
    """The data of each server-sent event: parsed JSON, or chat's and completions' `[DONE]`."""
    return [data if data == "[DONE]" else json.loads(data) for _, data in conformance.sse_frames(response.content)]


async def violations(client: httpx.AsyncClient, route: str, body: dict, check_json, check_stream) -> list[str]:
    """POST `body`; the violations the route's checks find in its answer (a 200)."""
    response = await client.post(route, json=body)
    assert response.status_code == 200, response.text
    return check_stream(payloads(response), body) if body.get("stream") else check_json(response.json(), body)


# -- real requests -------------------------------------------------------------------------------

CHAT = [
    {"messages": HELLO, "max_tokens": 8},
    {"messages": HELLO, "max_tokens": 8, "stream": True},
    {"messages": HELLO, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, "n": 2, "logprobs": True, "top_logprobs": 2},
    {"messages": HELLO, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2},
    {"messages": PARIS, "max_tokens": CALL_TOKENS, **CHAT_CALL},
    {"messages": PARIS, "max_tokens": CALL_TOKENS, **CHAT_CALL, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": PARIS, "max_tokens": 12, **CHAT_CALL, "stream": True},  # cut short
]


async def test_chat_completions_conform(app_client):
    async with app_client() as client:
        for body in CHAT:
            found = await violations(client, "/v1/chat/completions", {"model": MODEL, "temperature": 0, **body},
                                     conformance.chat_completion, conformance.chat_stream)
            assert not found, "\n".join(found)


async def test_completions_conform(app_client):
    async with app_client() as client:
        for body in ({"prompt": "Hello", "max_tokens": 6, "logprobs": 2},
                     {"prompt": ["Hello", "Bye"], "n": 2, "max_tokens": 6, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}},
                     {"prompt": [1, 2, 3], "max_tokens": 6, "stream": True}):
            found = await violations(client, "/v1/completions", {"model": MODEL, "temperature": 0, **body},
                                     conformance.completion, conformance.completion_stream)
            assert not found, "\n".join(found)


async def test_responses_conform(app_client):
    tools = {"tools": [{"type": "function", **FUNCTION}], "tool_choice": "required", "parallel_tool_calls": False}
    async with app_client() as client:
        for body in ({"input": "Say hello.", "max_output_tokens": 8}, {"input": "Say hello.", "max_output_tokens": 8, "stream": True},
                     {"input": PARIS, "max_output_tokens": CALL_TOKENS, **tools},
                     {"input": PARIS, "max_output_tokens": CALL_TOKENS, "stream": True, **tools},
                     {"input": PARIS, "max_output_tokens": 12, "stream": True, **tools}):
            found = await violations(client, "/v1/responses", {"model": MODEL, "temperature": 0, "store": False, **body},
                                     conformance.response, conformance.response_stream)
            assert not found, "\n".join(found)


async def test_messages_conform(app_client):
    tools = {"tools": [{"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": PARAMETERS}],
             "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    async with app_client() as client:
        for body in ({"messages": HELLO, "max_tokens": 8}, {"messages": HELLO, "max_tokens": 8, "stream": True},
                     {"messages": PARIS, "max_tokens": CALL_TOKENS, **tools},
                     {"messages": PARIS, "max_tokens": CALL_TOKENS, "stream": True, **tools},
                     {"messages": PARIS, "max_tokens": 12, "stream": True, **tools}):
            found = await violations(client, "/v1/messages", {"model": MODEL, "temperature": 0, **body},
                                     conformance.message, conformance.message_stream)
            assert not found, "\n".join(found)


@contextlib.asynccontextmanager
async def recorded(loaded, **settings):
    """`async with recorded(loaded) as (client, recorder)`: an in-process app behind its
    `conformance.Recorder` (tests/inprocess.py)."""
    async with served(loaded, **settings) as s:
        yield s.http, s.recorder


@pytest.fixture(scope="module")
def thinker(tokenizer):
    """A tiny thinking model whose template opens the thinking in the prompt: with a budget of
    3, its reply is 3 tokens of reasoning, the forced end marker, then the answer."""
    return thinking.tiny_model(thinking.family_tokenizer(tokenizer, "deepseek_r1"))


async def test_a_thinking_model_s_reasoning_conforms(thinker):
    """Reasoning then answer: chat's two reasoning fields (the allowed extensions), a Responses
    reasoning item closed before the message opens (with its summary, asked for), a signed
    Messages thinking block before the text block."""
    chat = {"model": "tiny-deepseek_r1", "messages": HELLO, "max_tokens": 8, "temperature": 0, "max_reasoning_tokens": 3}
    turn = {"model": "tiny-deepseek_r1", "input": "Say hello.", "max_output_tokens": 8, "temperature": 0, "max_reasoning_tokens": 3,
            "reasoning": {"summary": "auto"}, "store": False}
    message = {"model": "tiny-deepseek_r1", "messages": HELLO, "max_tokens": 8, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 3}}
    async with recorded(thinker) as (client, recorder):
        for route, body in [("/v1/chat/completions", chat), ("/v1/chat/completions", chat | {"stream": True, "n": 2}),
                            ("/v1/responses", turn), ("/v1/messages", message)]:
            assert (await client.post(route, json=body)).status_code == 200
        events = payloads(await client.post("/v1/responses", json=turn | {"stream": True}))
        blocks = payloads(await client.post("/v1/messages", json=message | {"stream": True}))
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["reasoning", "message"]
    assert "response.reasoning_summary_text.delta" in [e["type"] for e in events]
    assert [e["content_block"]["type"] for e in blocks if e["type"] == "content_block_start"] == ["thinking", "text"]
    assert len(recorder.seen) == 6
    recorder.check()


async def test_a_thinking_model_s_logprobs_conform(thinker):
    """The end marker the budget forces is sampled under a one-token mask when logprobs are
    asked, so it carries the model's logprob, a number, as the SDK requires."""
    chat = {"model": "tiny-deepseek_r1", "messages": HELLO, "max_tokens": 8, "temperature": 0, "max_reasoning_tokens": 3,
            "logprobs": True, "top_logprobs": 1}
    async with recorded(thinker) as (client, recorder):
        for body in (chat, chat | {"stream": True}):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    recorder.check()


async def test_streams_cut_by_an_error_conform_up_to_it(app_client):
    """A stream that runs past its deadline ends with the route's error (chat's error object,
    Messages' error event): what came before conforms, the error is typed, nothing follows it."""
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 1000, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS}}}
    message = {"model": MODEL, "messages": HELLO, "max_tokens": 1000, "stream": True,
               "tools": [{"name": "count", "input_schema": NUMBERS}], "tool_choice": {"type": "any"}}
    async with app_client(request_timeout_s=1.5) as client:
        for route, body, check in [("/v1/chat/completions", chat, conformance.chat_stream), ("/v1/messages", message, conformance.message_stream)]:
            events = payloads(await client.post(route, json=body))
            assert "timeout" in json.dumps(events[-1]), events[-1]
            found = check(events, body)
            assert not found, "\n".join(found)


async def test_a_responses_stream_that_failed_conforms(app_client):
    """A Responses stream past its deadline ends with response.failed; what came before conforms."""
    async with app_client(request_timeout_s=1.5) as client:
        body = {"model": MODEL, "input": "Count.", "max_output_tokens": 1000, "stream": True, "store": False,
                "text": {"format": {"type": "json_schema", "name": "numbers", "schema": NUMBERS}}}
        events = payloads(await client.post("/v1/responses", json=body))
    assert events[-1]["type"] == "response.failed"
    found = conformance.response_stream(events, body)
    assert not found, "\n".join(found)


# -- the checks fail when they should ------------------------------------------------------------

def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "system_fingerprint": "fp",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], "usage": None}


CHAT_REQUEST = {"stream": True, "stream_options": {"include_usage": True}}
USAGE_CHUNK = {**chunk({}), "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
CHAT_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Hm.", "reasoning": "Hm."}),
    chunk({"content": "Hi"}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
    chunk({}, "tool_calls"),
    USAGE_CHUNK,
    "[DONE]",
]


def mutated(events: list, edit) -> list:
    out = copy.deepcopy(events)
    edit(out)
    return out


def renumbered(events: list[dict]) -> list[dict]:
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


def response_object(status: str, output: list[dict]) -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "error": None, "incomplete_details": None, "model": "m",
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


MESSAGE_ITEM = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}]}
CALL_ITEM = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "status": "completed", "name": "f", "arguments": "{}"}
AT_MESSAGE = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
AT_CALL = {"item_id": "fc_1", "output_index": 1}
RESPONSE_EVENTS = [  # numbered once edited (`renumbered`)
    {"type": "response.created", "response": response_object("in_progress", [])},
    {"type": "response.in_progress", "response": response_object("in_progress", [])},
    {"type": "response.output_item.added", "output_index": 0, "item": {**MESSAGE_ITEM, "status": "in_progress", "content": []}},
    {"type": "response.content_part.added", **AT_MESSAGE, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}},
    {"type": "response.output_text.delta", **AT_MESSAGE, "delta": "Hi", "logprobs": []},
    {"type": "response.output_text.delta", **AT_MESSAGE, "delta": " there", "logprobs": []},
    {"type": "response.output_text.done", **AT_MESSAGE, "text": "Hi there", "logprobs": []},
    {"type": "response.content_part.done", **AT_MESSAGE, "part": MESSAGE_ITEM["content"][0]},
    {"type": "response.output_item.done", "output_index": 0, "item": MESSAGE_ITEM},
    {"type": "response.output_item.added", "output_index": 1, "item": {**CALL_ITEM, "status": "in_progress", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", **AT_CALL, "delta": "{}"},
    {"type": "response.function_call_arguments.done", **AT_CALL, "arguments": "{}"},
    {"type": "response.output_item.done", "output_index": 1, "item": CALL_ITEM},
    {"type": "response.completed", "response": response_object("completed", [MESSAGE_ITEM, CALL_ITEM])},
]
RESPONSE_STREAM = renumbered(RESPONSE_EVENTS)


def block_delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


MESSAGE_STREAM = [
    {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                                          "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}},
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
    block_delta(0, {"type": "thinking_delta", "thinking": "Hm."}),
    block_delta(0, {"type": "signature_delta", "signature": "c2ln"}),
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
    block_delta(1, {"type": "text_delta", "text": "Hi"}),
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}},
    block_delta(2, {"type": "input_json_delta", "partial_json": '{"a"'}),
    block_delta(2, {"type": "input_json_delta", "partial_json": ": 1}"}),
    {"type": "content_block_stop", "index": 2},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 5}},
    {"type": "message_stop"},
]


def test_the_hand_written_streams_conform():
    """The base of every mutation below conforms: each violation there is the mutation's."""
    assert conformance.chat_stream(CHAT_STREAM, CHAT_REQUEST) == []
    assert conformance.response_stream(RESPONSE_STREAM) == []
    assert conformance.message_stream(MESSAGE_STREAM) == []


def _insert(at: int, item):
    return lambda events: events.insert(at, item)


@pytest.mark.parametrize("edit, says", [
    (_insert(6, chunk({"content": "late"})), "after its finish_reason"),
    (_insert(3, chunk({"reasoning_content": "more", "reasoning": "more"})), "reasoning after the content started"),
    (lambda e: e[2]["choices"][0]["delta"].update(surprise=1), "undeclared field choices[].delta.surprise (not in ChoiceDelta)"),
    (lambda e: e[2]["choices"][0]["delta"].update(reasoning="other"), "reasoning and reasoning_content differ"),
    (lambda e: e[2].pop("created"), "created: Field required"),
    (lambda e: e[2].update(id="chatcmpl-2"), "differ from the first chunk's"),
    (lambda e: e[0]["choices"][0]["delta"].pop("role"), "has no role"),
    (lambda e: e[4]["choices"][0]["delta"]["tool_calls"][0].update(id="call_2"), "repeats its id"),
    (lambda e: e[4]["choices"][0]["delta"]["tool_calls"][0].update(index=2), "tool call index 2 out of order"),
    (lambda e: e[3]["choices"][0]["delta"]["tool_calls"][0]["function"].pop("name"), "lacks its id, type or name"),
    (lambda e: e[4]["choices"][0]["delta"]["tool_calls"][0]["function"].update(arguments=": 1"), "arguments are not a JSON object"),
    (lambda e: e[5]["choices"][0].update(finish_reason=None), "never got a finish_reason"),
    (lambda e: e[2].update(usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}), "usage on a chunk with choices"),
    (lambda e: e.pop(6), "no usage chunk with stream_options.include_usage"),
    (_insert(6, USAGE_CHUNK), "the usage chunk must be the last one"),
    (lambda e: e.pop(), "does not end with data: [DONE]"),
    (lambda e: e.append("[DONE]"), "data after [DONE]"),
    (lambda e: e[1]["choices"][0].update(logprobs={"content": [{"token": "x", "logprob": None, "bytes": [120], "top_logprobs": []}]}),
     "logprob: Input should be a valid number"),
])
def test_a_broken_chat_stream_is_a_violation(edit, says):
    found = conformance.chat_stream(mutated(CHAT_STREAM, edit), CHAT_REQUEST)
    assert any(says in v for v in found), found


def test_a_chat_stream_cut_by_an_error_is_checked_up_to_it():
    error = {"error": {"message": "the request ran longer than its 1.5 s deadline", "type": "server_error", "param": None, "code": "timeout"}}
    assert conformance.chat_stream(CHAT_STREAM[:3] + [error], CHAT_REQUEST) == []
    found = conformance.chat_stream(CHAT_STREAM[:3] + [{"error": {"message": "x"}}], CHAT_REQUEST)
    assert any("not OpenAI's error shape" in v for v in found), found
    found = conformance.chat_stream(CHAT_STREAM[:3] + [{"error": {**error["error"], "code": 504}}], CHAT_REQUEST)
    assert any("code: Input should be a valid string" in v for v in found), found


def _swap(i: int, j: int):
    def edit(events):
        events[i], events[j] = events[j], events[i]
    return edit


@pytest.mark.parametrize("edit, says", [
    (_swap(8, 9), "item 1 opened before item 0 closed"),
    (_swap(0, 1), "must start with response.created"),
    (lambda e: e[4].update(surprise=1), "undeclared field surprise (not in ResponseTextDeltaEvent)"),
    (lambda e: e[13]["response"].update(surprise=1), "undeclared field response.surprise (not in Response)"),
    (lambda e: e[4].pop("item_id"), "item_id: Field required"),
    (lambda e: e[4].update(item_id="msg_2"), "but the open item is"),
    (lambda e: e[4].update(content_index=1), "not the open output_text part"),
    (lambda e: e[6].update(text="Hi"), "its text differs from its deltas"),
    (lambda e: e[7]["part"].update(text="Hi"), "the part differs"),
    (lambda e: e.pop(6), "closed before its text's done event"),
    (lambda e: e.pop(7), "closed with its part ('content', 0) open"),
    (lambda e: e[8]["item"]["content"][0].update(text="Hello"), "content differs from its parts streamed"),
    (lambda e: e[11].update(arguments='{"a": 1}'), "arguments differ from the deltas joined"),
    (lambda e: e[9].update(output_index=2), "output_index 2, expected 1"),
    (lambda e: e[13]["response"].update(output=[MESSAGE_ITEM]), "final response's output differs"),
    (lambda e: e[13]["response"].update(status="incomplete"), "response status incomplete, expected completed"),
    (lambda e: e[13]["response"].update(incomplete_details={"reason": "max_output_tokens"}), "with incomplete_details"),
    (lambda e: e[13]["response"].update(id="resp_2"), "response id resp_2, not resp_1"),
    (lambda e: e.pop(), "ended without response.completed"),
    (_insert(5, {"type": "response.nope"}), "an unknown event type 'response.nope'"),
])
def test_a_broken_responses_stream_is_a_violation(edit, says):
    found = conformance.response_stream(renumbered(mutated(RESPONSE_EVENTS, edit)))
    assert any(says in v for v in found), found


def test_a_skipped_sequence_number_is_a_violation():
    skipped = RESPONSE_STREAM[:5] + [{**e, "sequence_number": e["sequence_number"] + 1} for e in RESPONSE_STREAM[5:]]
    assert conformance.response_stream(skipped) == [f"POST /v1/responses (stream): event {k} ({e['type']}): sequence_number {k + 1}, expected {k}"
                                                    for k, e in enumerate(RESPONSE_STREAM) if k >= 5]


def test_a_responses_stream_that_failed_is_checked_up_to_it():
    failed = {"type": "response.failed", "response": {**response_object("failed", []), "error": {"code": "server_error", "message": "timeout"}}}
    assert conformance.response_stream(renumbered(RESPONSE_EVENTS[:5] + [failed])) == []
    found = conformance.response_stream(renumbered(RESPONSE_EVENTS[:5] + [failed] + RESPONSE_EVENTS[5:6]))
    assert any("an event after response.failed" in v for v in found), found


@pytest.mark.parametrize("edit, says", [
    (lambda e: e.pop(5), "block 1 started before block 0 stopped"),
    (lambda e: e[6].update(index=2), "block index 2, expected 1"),
    (lambda e: e[7].update(index=0), "a delta for block 0, but the open block is 1"),
    (lambda e: e[10].update(delta={"type": "text_delta", "text": "x"}), "a text_delta in a tool_use block"),
    (lambda e: e[11]["delta"].update(partial_json=": 1"), "input joined is not a JSON object"),
    (lambda e: e[3]["delta"].update(surprise=1), "undeclared field delta.surprise (not in ThinkingDelta)"),
    (lambda e: e[0]["message"].pop("role"), "message.role: Field required"),
    (lambda e: e.pop(4), "a thinking block without its signature"),
    (lambda e: e[13]["delta"].update(stop_reason="end_turn", stop_sequence="x"), "stop_sequence 'x' with stop_reason end_turn"),
    (_insert(14, {"type": "content_block_stop", "index": 2}), "only message_stop may follow message_delta"),
    (lambda e: e.pop(13), "message_stop does not follow message_delta"),
    (lambda e: e.pop(), "ended without message_stop"),
    (_insert(14, {"type": "ping"}), None),  # a ping may come anywhere
    (lambda e: e[1].update(data=1), "a ping with fields"),
])
def test_a_broken_messages_stream_is_a_violation(edit, says):
    found = conformance.message_stream(mutated(MESSAGE_STREAM, edit))
    assert any(says in v for v in found) if says else not found, found


def test_a_messages_stream_cut_by_an_error_is_checked_up_to_it():
    error = {"type": "error", "error": {"type": "api_error", "message": "timeout"}}
    assert conformance.message_stream(MESSAGE_STREAM[:4] + [error]) == []
    found = conformance.message_stream(MESSAGE_STREAM[:4] + [{"type": "error", "error": {"message": "timeout"}}])
    assert any("not Anthropic's error shape" in v for v in found), found
    found = conformance.message_stream(MESSAGE_STREAM[:4] + [{"type": "error", "error": {"type": "teapot_error", "message": "timeout"}}])
    assert any("not a valid ErrorResponse" in v for v in found), found


def test_strict_refuses_undeclared_and_missing_fields_and_wrong_types():
    """The SDK models allow extra fields and coerce; `strict` does neither, and allows only the
    listed extensions, on the model that owns them."""
    from openai.types.chat import ChatCompletion

    completion = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "logprobs": None,
         "message": {"role": "assistant", "content": "Hi", "reasoning_content": "Hm.", "reasoning": "Hm."}}]}
    parsed, found = conformance.strict(ChatCompletion, completion)
    assert isinstance(parsed, ChatCompletion) and found == []
    assert conformance.strict(ChatCompletion, completion, frozenset())[1] == [
        "undeclared field choices[].message.reasoning_content (not in ChatCompletionMessage)",
        "undeclared field choices[].message.reasoning (not in ChatCompletionMessage)"]
    assert conformance.strict(ChatCompletion, {**completion, "reasoning": "x"})[1] == ["undeclared field reasoning (not in ChatCompletion)"]
    assert "created: Input should be a valid integer" in conformance.strict(ChatCompletion, {**completion, "created": "1"})[1][0]
    assert "choices: Field required" in conformance.strict(ChatCompletion, {k: v for k, v in completion.items() if k != "choices"})[1][0]


def test_each_event_s_name_is_its_type_and_a_stream_is_what_was_asked():
    """Responses and Messages events are named by their `type`; chat's are unnamed; a request
    for a stream gets one."""
    renamed = b'event: message_stop\r\ndata: {"type": "ping"}\r\n\r\n'
    found = conformance.check_exchange("/v1/messages", {"stream": True}, 200, "text/event-stream", renamed)
    assert "POST /v1/messages: an event named 'message_stop' whose data has type 'ping' -- {\"type\": \"ping\"}" in found
    named = b'event: chunk\r\ndata: [DONE]\r\n\r\n'
    assert "POST /v1/chat/completions: a named event 'chunk' (chunks are unnamed) -- [DONE]" in \
        conformance.check_exchange("/v1/chat/completions", {"stream": True}, 200, "text/event-stream", named)
    found = conformance.check_exchange("/v1/messages", {"stream": True}, 200, "application/json", json.dumps(MESSAGE_STREAM[0]["message"]).encode())
    assert found == ["POST /v1/messages: stream True answered as application/json"]
    assert conformance.check_exchange("/v1/messages", {}, 400, "application/json", b"{}") == []


# -- the Recorder --------------------------------------------------------------------------------

async def test_the_recorder_checks_what_the_app_sends_and_changes_nothing(smollm2):
    """Streamed and JSON answers of the four routes are checked as sent; other requests, errors
    and other routes are let through unchecked, and the bytes are the app's."""
    async with recorded(smollm2) as (client, recorder):
        streamed = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": True})
        assert streamed.text.endswith("data: [DONE]\r\n\r\n")
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True, "store": False})
        await client.post("/v1/messages", json={"model": MODEL, "messages": HELLO, "max_tokens": 4})
        assert (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})).status_code == 400
        assert (await client.post("/tokenize", json={"model": MODEL, "prompt": "Hi"})).status_code == 200
    assert recorder.seen == [("/v1/chat/completions", "text/event-stream"), ("/v1/completions", "application/json"),
                             ("/v1/responses", "text/event-stream"), ("/v1/messages", "application/json")]
    recorder.check()


async def record_fake_stream(frames: list[bytes], *, leave: bool = False):
    """A `Recorder` around an app that streams `frames` on /v1/chat/completions (the client
    leaving first when `leave`); (the recorder, the bytes the client got)."""
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for frame in frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        if leave:
            await receive()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    recorder, got = conformance.Recorder(app), bytearray()
    requests = iter([{"type": "http.request", "body": json.dumps({"stream": True}).encode(), "more_body": False}, {"type": "http.disconnect"}])

    async def receive():
        return next(requests)

    async def send(message):
        got.extend(message.get("body", b""))

    await recorder({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, receive, send)
    return recorder, bytes(got)


async def test_the_recorder_reports_a_broken_stream_and_skips_one_the_client_left():
    surprise = chunk({"content": "!"}, "stop") | {"surprise": 1}
    frames = [f"data: {json.dumps(chunk({'role': 'assistant', 'content': 'Hi'}))}\r\n\r\n".encode(), b": ping - now\r\n\r\n",
              f"data: {json.dumps(surprise)}\r\n\r\n".encode(), b"data: [DONE]\r\n\r\n"]
    recorder, got = await record_fake_stream(frames)
    assert got == b"".join(frames)
    assert recorder.violations == ["POST /v1/chat/completions (stream): chunk 1: undeclared field surprise (not in ChatCompletionChunk) -- "
                                   + json.dumps(surprise)]
    with pytest.raises(AssertionError, match="1 conformance violations"):
        recorder.check()
    left, got = await record_fake_stream(frames[:1], leave=True)
    assert got == frames[0] and left.violations == [] and left.seen == []
