"""Agent clients as they come (issue 36), in-process on the real model: the Codex CLI's hosted
tools, a call cut by the token limit sent back (LangChain does), a response retrieved while it
is generated, and OpenAI's errors for what clients get wrong, read with the official SDK."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai import AsyncOpenAI

from tests.server.test_api import MODEL, assert_error_shape, sse_payloads

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    "strict": True,
}
# What `codex exec` sends with its default config (tools abridged): a function tool among
# hosted and freeform ones, `reasoning`, `include`, `store: false`, a prompt_cache_key.
CODEX = {
    "model": MODEL, "instructions": "You are a coding agent.", "stream": True, "store": False,
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}},
        {"type": "local_shell"},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "namespace", "name": "mcp", "tools": []},
        {"type": "web_search"},
    ],
    "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "codex-conversation-1", "max_output_tokens": 8,
}
DROPPED = "x-kvserve-dropped-tools"


def sdk(client) -> AsyncOpenAI:
    """The official SDK on the in-process app."""
    return AsyncOpenAI(base_url="http://kvserve/v1", api_key="unused", http_client=client, max_retries=0)


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def test_hosted_tools_are_dropped_and_named_in_a_header(app_client):
    async with app_client() as client:
        codex = await client.post("/v1/responses", json=CODEX)
        assert codex.status_code == 200, codex.text
        assert codex.headers[DROPPED] == "local_shell, custom, namespace, web_search"
        events = sse_payloads(codex.text)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert [t["name"] for t in events[-1]["response"]["tools"]] == ["shell"]  # the tools it ran with

        api = sdk(client)
        raw = await api.responses.with_raw_response.create(
            model=MODEL, input="Weather in Paris?", tools=[{"type": "web_search"}, WEATHER, {"type": "web_search"}],
            tool_choice="required", max_output_tokens=30, temperature=0,
        )
        assert raw.headers[DROPPED] == "web_search"
        response = raw.parse()
        assert [(i.type, i.name) for i in response.output] == [("function_call", "get_weather")]
        plain = await api.responses.with_raw_response.create(model=MODEL, input="Hi.", tools=[WEATHER], max_output_tokens=2)
        assert DROPPED not in plain.headers
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(model=MODEL, input="Hi.", tools=[{"type": "web_search"}, WEATHER], tool_choice={"type": "web_search"})
        assert err.value.body["param"] == "tool_choice" and "web_search" in err.value.body["message"]

        custom = {"type": "custom", "custom": {"name": "apply_patch"}}
        chat = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=30, temperature=0,
            tools=[custom, {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}], tool_choice="required",
        )
        assert chat.headers[DROPPED] == "custom"
        assert chat.parse().choices[0].message.tool_calls[0].function.name == "get_weather"
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], tools=[custom],
                                              tool_choice={"type": "custom", "custom": {"name": "apply_patch"}})
        assert err.value.body["param"] == "tool_choice" and err.value.body["code"] == "invalid_value"


async def test_a_call_cut_by_the_token_limit_is_continued_as_written(app_client):
    async with app_client() as client:
        api = sdk(client)
        cut = await api.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                         max_output_tokens=16, temperature=0)
        call = cut.output[0]
        assert cut.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
        with pytest.raises(ValueError):
            json.loads(call.arguments)  # its arguments so far
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "cut short, try again"}

        continued = await api.responses.create(model=MODEL, previous_response_id=cut.id, input=[output], tools=[WEATHER], max_output_tokens=2)
        assert continued.previous_response_id == cut.id and continued.usage.input_tokens > cut.usage.input_tokens
        # LangChain keeps the history itself and sends the cut call back
        history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), output]
        resent = await api.responses.create(model=MODEL, input=history, tools=[WEATHER], store=False, max_output_tokens=2, temperature=0)
        assert resent.status == "incomplete"

        chat = await api.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "cut short, try again"},
        ], tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}])
        assert chat.choices[0].finish_reason == "length"


class Stream:
    """One streamed POST /v1/responses driven by hand (httpx's ASGI transport only returns a
    response once it has ended): `created()` waits for its first event and holds the stream
    there until `resume()`; `leave()` is the client going away."""

    def __init__(self, client, body: dict) -> None:
        self.app = client._transport.app
        self.headers = [(k.encode(), v.encode()) for k, v in client.headers.items() if k == "authorization"]
        self.body = json.dumps(body).encode()
        self.events: list[bytes] = []
        self.first = asyncio.Event()
        self.go_on = asyncio.Event()
        self.gone = asyncio.Event()

    async def _receive(self):
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self.events.append(message["body"])
            if not self.first.is_set():
                self.first.set()
                await self.go_on.wait()

    def start(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"kvserve"), (b"content-type", b"application/json"), *self.headers],
                 "client": ("test", 1), "server": ("kvserve", 80)}
        self.task = asyncio.create_task(self.app(scope, self._receive, self._send))

    async def created(self) -> dict:
        await asyncio.wait_for(self.first.wait(), 60)
        return sse_payloads(self.events[0].decode())[0]

    async def resume(self) -> list[dict]:
        self.go_on.set()
        await asyncio.wait_for(self.task, 120)
        return sse_payloads(b"".join(self.events).decode())

    async def leave(self) -> None:
        self.gone.set()
        self.go_on.set()
        await asyncio.wait_for(self.task, 120)


async def test_a_response_is_retrievable_while_it_is_generated(app_client):
    """In progress from admission to its end: retrievable (`in_progress`), not continuable nor
    deletable; a stream the client leaves is forgotten."""
    body = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 12, "temperature": 0}
    async with app_client(api_key=["key-a"]) as client:
        client.headers["Authorization"] = "Bearer key-a"
        stream = Stream(client, {**body, "stream": True})
        stream.start()
        created = await stream.created()
        rid = created["response"]["id"]
        running = await client.get(f"/v1/responses/{rid}")
        assert running.status_code == 200 and running.json()["status"] == "in_progress" and running.json()["output"] == []
        items = (await client.get(f"/v1/responses/{rid}/input_items")).json()["data"]
        assert items[0]["content"][0]["text"] == "Tell me a story."
        error = assert_error_shape(await client.post("/v1/responses", json={**body, "previous_response_id": rid}), 400, "response_in_progress", "previous_response_id")
        assert rid in error["message"] and "in progress" in error["message"]
        assert_error_shape(await client.delete(f"/v1/responses/{rid}"), 400, "response_in_progress", "response_id")
        events = await stream.resume()
        done = await client.get(f"/v1/responses/{rid}")
        assert done.json() == events[-1]["response"] and done.json()["status"] == "incomplete"
        assert (await client.post("/v1/responses", json={**body, "previous_response_id": rid})).status_code == 200

        left = Stream(client, {**body, "stream": True})
        left.start()
        rid = (await left.created())["response"]["id"]
        await left.leave()
        assert_error_shape(await client.get(f"/v1/responses/{rid}"), 404, "response_not_found")

        # A response answered whole shows its id only at its end; before, it names the session
        # its turn runs in (the key's sessions are listed).
        async def sessions() -> set[str]:
            return {s["id"] for s in (await client.get("/v1/sessions")).json()["data"]}

        before = await sessions()
        whole = asyncio.create_task(client.post("/v1/responses", json={**body, "max_output_tokens": 64}))
        while not (new := await sessions() - before) and not whole.done():
            await asyncio.sleep(0.01)
        (rid,) = new
        assert (await client.get(f"/v1/responses/{rid}")).json()["status"] == "in_progress"
        assert (await whole).json()["id"] == rid
        assert (await client.get(f"/v1/responses/{rid}")).json()["status"] == "incomplete"


async def test_openai_errors_for_what_clients_get_wrong(app_client):
    async with app_client() as client:
        api = sdk(client)
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "call_nope", "output": "18 C"}])
        assert err.value.body == {"message": "No tool call found for function call output with call_id call_nope.",
                                  "type": "invalid_request_error", "param": "input", "code": "invalid_value"}

        error = assert_error_shape(await client.post("/v1/responses", json={"model": MODEL, "input": []}), 400, "empty_array", "input")
        assert error["message"] == "Invalid 'input': empty array. Expected an array with minimum length 1, but got an empty array instead."

        long = "hello " * 9000
        assert_error_shape(await client.post("/v1/responses", json={"model": MODEL, "input": long}), 400, "context_length_exceeded", "input")
        assert_error_shape(await client.post("/v1/responses", json={"model": MODEL, "input": long, "max_output_tokens": 5}), 400, "context_length_exceeded", "input")
        assert_error_shape(await client.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 9000}), 400, "context_length_exceeded", "max_output_tokens")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": long}]}
        assert_error_shape(await client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded", "messages")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 9000}
        assert_error_shape(await client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded", "max_tokens")

        # a body nested deeper than the JSON parser goes, and one that is not JSON at all
        headers = {"content-type": "application/json"}
        deep = b'{"model": "m", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for path in ("/v1/responses", "/v1/chat/completions"):
            error = assert_error_shape(await client.post(path, content=deep, headers=headers), 400, "invalid_request")
            assert error["param"] is None and error["message"].startswith("We could not parse the JSON body of your request: it nests too deeply")
        error = assert_error_shape(await client.post("/v1/responses", content=b'{"model": ', headers=headers), 400, "invalid_request")
        assert error["message"].startswith("We could not parse the JSON body of your request")

        # nesting the body parser takes but a chat template would not: never a 500
        call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(nested(900))}}]}
        messages = [{"role": "user", "content": "Hi."}, call, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        assert (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})).status_code == 200
        tools = [{"type": "function", "function": {"name": "f", "parameters": nested(600)}}]
        chat = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages[:1], "tools": tools, "max_tokens": 1})
        assert_error_shape(chat, 400, "invalid_value", "tools")


async def test_an_empty_messages_list_is_openais_empty_array(app_client):
    async with app_client() as client:
        r = await client.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": []})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "empty_array" and r.json()["error"]["param"] == "messages"
