"""POST /v1/responses and the stored-response routes: a Responses turn is a chat turn in a session.

A turn's conversation is the stored one of `previous_response_id` (its earlier input and output
items) followed by the new input. It becomes a chat request once (`protocol_responses.chat_messages`:
items -> messages, a reasoning item as the next assistant turn's `reasoning_content`), is submitted
through the chat side (`serving_chat.submit`: thinking controls, template, limits, grammar) and its
output is assembled by the same `Assembly` chat renders (server/api/assembly.py), here as output
items and their events (`Output`). It is generated in a kvserve session of the caller's principal:

* `prompt_cache_key` when given, else the session of the previous response, else the
  `X-Session-ID` header, else (with `store`) the new response's own id. So a chain of
  responses shares the session named after its first response id, and each turn prefills only
  what the previous one did not (device, host or disk tier; restart included).
* Without `store` and without any of those names, the turn runs like an anonymous chat request.

Because the session only caches what the rendered conversation already is, a continued turn's
greedy output equals that of the same history sent whole (the equivalence invariant).

A stored turn is retrievable from admission on, `in_progress` until it ends (the store's
`begin`); a failed or abandoned one is removed, as it is never stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter
from sse_starlette import EventSourceResponse

from cache_manager.sessions import EntryPinnedError
from server.api import serving, serving_chat
from server.api.assembly import Parts
from server.api.errors import APIError
from server.api.protocol_responses import InputItemsQuery, Item, ResponsesRequest, item_id, reasoning_item
from server.api.response_store import ResponseStore, StoredResponse
from server.engine.sequence import RequestOutput
from server.api.serving import ServingContext

log = logging.getLogger(__name__)

ROUTE = "/v1/responses"
_ITEMS = TypeAdapter(list[Item])


def not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"No response found with id '{response_id}' (never stored, stored with store: false, "
        "deleted, evicted from the response store, or another API key's)",
        code="response_not_found", param=param,
    )


def in_progress(response_id: str, param: str) -> APIError:
    return APIError(
        400,
        f"Response '{response_id}' is still in progress: it can be continued or deleted once it has "
        "completed (retrieve it to see its status)",
        code="response_in_progress", param=param, rejection="bad_request",
    )


def unmatched_output(conversation: list[dict], input_items: list[dict]) -> APIError | None:
    """OpenAI's 400 for a function_call_output in this input whose call_id no function_call
    of the conversation (earlier turns and this input) has."""
    calls = {item["call_id"] for item in conversation if item["type"] == "function_call"}
    for item in input_items:
        if item["type"] == "function_call_output" and item["call_id"] not in calls:
            return APIError(
                400, f"No tool call found for function call output with call_id {item['call_id']}.",
                code="invalid_value", param="input", rejection="bad_request",
            )
    return None


@contextlib.contextmanager
def _renamed(**params: str):
    """Errors raised by the chat helpers name chat's fields; say the Responses field instead."""
    try:
        yield
    except APIError as exc:
        exc.param = params.get(exc.param, exc.param)
        raise


@dataclass(slots=True)
class Turn:
    """One POST /v1/responses being answered."""

    id: str
    body: ResponsesRequest
    principal: str
    session_id: str | None
    input_items: list[dict]  # this turn's input, with ids
    conversation: list[dict]  # earlier turns + this input
    submitted: serving_chat.Submitted  # its sequence, and how its output is assembled
    created_at: int
    arrived: float  # time.monotonic() when the request arrived (latency metrics)

    @property
    def summary(self) -> bool:
        """The request asked for reasoning summaries (`reasoning.summary`)."""
        return self.body.reasoning is not None and self.body.reasoning.summary is not None

    def response(self, status: str, output: list[dict], final: RequestOutput | None = None, error: dict | None = None) -> dict:
        """The response object (OpenAI's field order)."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" and final is not None and final.finish_reason == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "model": body.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": body.reasoning.effort, "summary": body.reasoning.summary} if body.reasoning else {"effort": None, "summary": None},
            "service_tier": "default",
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format()},
            "tool_choice": body.tool_choice_wire(),
            "tools": [t.model_dump(exclude_none=True) for t in body.function_tools()],
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage(final) if final is not None else None,
            "user": body.user,
        }


def usage(final: RequestOutput) -> dict:
    return {
        "input_tokens": final.prompt_tokens,
        # nothing is billed for writing the cache: 0, as the SDK's typed model requires the field
        "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def status_of(final: RequestOutput, assembly) -> str:
    """`completed` when the engine stopped or the turn's calls are complete (the tool-call
    parser's "tool_calls": a repeated call ended them, whatever the token limit did after),
    else `incomplete`: the status chat's finish_reason gives the same turn."""
    return "completed" if final.finish_reason == "stop" or assembly.finish_reason == "tool_calls" else "incomplete"


def message_item(message_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": message_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id_: str, call, status: str | None = None) -> dict:
    """A function_call item of a parsed call: "incomplete" when the token limit cut it."""
    status = status or ("completed" if call.complete else "incomplete")
    return {"id": item_id_, "type": "function_call", "call_id": call.id, "status": status, "name": call.name, "arguments": call.arguments}


class Output:
    """A turn's output items built from its `Assembly` as it comes: a reasoning item (a thinking
    model's), then a message (its text), then one function_call item per call, each opened
    when its first part arrives. `feed` returns the stream's events for a chunk of parts;
    `items` are the finished items (the same ids), for the response object and the store."""

    def __init__(self, ev: "Events | None" = None, *, summary: bool = False) -> None:
        self.ev = ev or Events()
        self.summary = summary  # the reasoning is its own summary (`reasoning.summary` asked for one)
        self.order: list[str] = []  # item ids in output order
        self.reasoning_id: str | None = None
        self.message_id: str | None = None
        self.call_ids: dict[int, str] = {}  # call index -> item id
        # what the open items hold so far (an item is closed, as OpenAI streams them, before the
        # next one opens: its text is final then): reasoning and message text, the calls
        self.text: dict[str, str] = {}
        self.calls: dict[str, object] = {}
        self.closed: dict[str, dict] = {}  # item id -> the item as its `done` events sent it

    def _add(self, prefix: str, item: dict) -> tuple[str, list[dict]]:
        """Open an item, closing the one open before it (the last item's `done` events come
        with the response, once its final text and status are known: `finish`)."""
        events = self._close_last()
        new_id = item["id"] = item_id(prefix)
        self.order.append(new_id)
        self.text[new_id] = ""
        return new_id, events + [self.ev("response.output_item.added", output_index=len(self.order) - 1, item=item)]

    def _close_last(self) -> list[dict]:
        """The `done` events of the item open now, complete since another follows it."""
        if not self.order or self.order[-1] in self.closed:
            return []
        last = self.order[-1]
        self.closed[last] = item = self._item(last, "completed")
        return closed_item(self.ev, len(self.order) - 1, item)

    def _item(self, some_id: str, status: str) -> dict:
        """Item `some_id` as it holds now (the reasoning's or message's text fed so far, a
        call's arguments so far), with `status` (a call's own: complete or cut)."""
        if some_id == self.reasoning_id:
            return reasoning_item(some_id, self.text[some_id], status, summary=self.summary)
        if some_id == self.message_id:
            return message_item(some_id, self.text.get(some_id, ""), status)
        return call_item(some_id, self.calls[some_id])

    def _index(self, some_id: str) -> int:
        return self.order.index(some_id)

    def feed(self, parts) -> list[dict]:
        """The events of a chunk of an `Assembly`'s parts (items opened as their first part comes)."""
        events = []
        if parts.reasoning:
            if self.reasoning_id is None:
                self.reasoning_id, opened = self._add("rs", reasoning_item("", None, "in_progress"))
                events += opened
                part = {"type": "reasoning_text", "text": ""}
                events.append(self.ev("response.content_part.added", item_id=self.reasoning_id, output_index=self._index(self.reasoning_id), content_index=0, part=part))
            events.append(self.ev("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=self._index(self.reasoning_id), content_index=0, delta=parts.reasoning))
            self.text[self.reasoning_id] += parts.reasoning
        if parts.content:
            if self.message_id is None:
                self.message_id, opened = self._add("msg", message_item("", None, "in_progress"))
                events += opened
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self.ev("response.content_part.added", item_id=self.message_id, output_index=self._index(self.message_id), content_index=0, part=part))
            events.append(self.ev("response.output_text.delta", item_id=self.message_id, output_index=self._index(self.message_id), content_index=0, delta=parts.content, logprobs=[]))
            self.text[self.message_id] += parts.content
        for call in parts.started:
            new_id, opened = self._add("fc", {**call_item("", call, "in_progress"), "arguments": ""})
            self.call_ids[call.index], self.calls[new_id] = new_id, call
            events += opened
        for index, text in parts.arguments.items():
            call_id = self.call_ids[index]
            events.append(self.ev("response.function_call_arguments.delta", item_id=call_id, output_index=self._index(call_id), delta=text))
        return events

    def items(self, assembly, final: RequestOutput) -> list[dict]:
        """The finished items: the reasoning, the message (an empty one when the turn made
        neither text nor calls), the calls."""
        status = status_of(final, assembly)
        calls = {call.index: call for call in assembly.calls}
        if self.message_id is None and not calls:
            self.message_id = item_id("msg")
            self.order.append(self.message_id)
        by_id = {}
        if self.reasoning_id is not None:
            by_id[self.reasoning_id] = self._item(self.reasoning_id, "completed" if calls or assembly.content or status == "completed" else status)
        if self.message_id is not None:
            by_id[self.message_id] = self._item(self.message_id, status)
        for index, call in calls.items():
            if index not in self.call_ids:  # released whole at the end (a held-back call)
                self.call_ids[index] = item_id("fc")
                self.order.append(self.call_ids[index])
            by_id[self.call_ids[index]] = call_item(self.call_ids[index], call)
        self.order = [i for i in self.order if i in by_id]  # a call the parser dropped (a repeat)
        return [self.closed.get(i, by_id[i]) for i in self.order]  # closed mid-stream: as its `done` events said

    def finish(self, items: list[dict], sent: set[str]) -> list[dict]:
        """The `done` events of every item not closed yet, in output order (an item never
        opened is sent whole: `added`, its text or arguments, `done`)."""
        events = []
        for index, item in enumerate(items):
            if item["id"] in self.closed:
                continue
            if item["id"] not in sent:
                events += self._whole(index, item)
            events += closed_item(self.ev, index, item)
        return events

    def _whole(self, index: int, item: dict) -> list[dict]:
        ev = self.ev
        if item["type"] == "function_call":
            return [ev("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                    ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            text = item["content"][0]["text"]
            events = [ev("response.output_item.added", output_index=index, item=message_item(item["id"], None, "in_progress")),
                      ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)]
            if text:
                events.append(ev("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=text, logprobs=[]))
            return events
        return [ev("response.output_item.added", output_index=index, item=reasoning_item(item["id"], None, "in_progress"))]


def output_items(assembly, final: RequestOutput, *, summary: bool = False) -> list[dict]:
    """The output of a finished turn, assembled whole (not streamed)."""
    out = Output(summary=summary)
    out.feed(_everything(assembly))
    return out.items(assembly, final)


def _everything(assembly) -> Parts:
    """All of a finished assembly as one chunk of parts (ids are given in output order)."""
    return Parts(reasoning=assembly.reasoning, content=assembly.content, started=list(assembly.calls),
                 arguments={c.index: c.arguments for c in assembly.calls})


async def prepare(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, request: Request):
    """Everything before admission: 404 for an unknown previous response, the conversation
    rendered, the grammar compiled, the sequence submitted. Returns (turn, engine handles)."""
    arrived = time.monotonic()
    ctx.check_model(body.model)
    principal = request.state.principal
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(principal, body.previous_response_id, in_progress=True)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        if previous.response["status"] == "in_progress":
            raise in_progress(body.previous_response_id, "previous_response_id")
    input_wire = [item.wire() for item in body.input_items()]
    conversation = (previous.conversation if previous is not None else []) + input_wire
    if (error := unmatched_output(conversation, input_wire)) is not None:
        raise error
    response_id = item_id("resp")
    if body.prompt_cache_key is None and previous is not None and previous.session_id is not None:
        session = previous.session_id  # the KV of the stored conversation, whatever header is sent
    else:
        session = serving.session_id(request, body.prompt_cache_key)
    if session is None and body.store and store.budget_bytes > 0:
        session = response_id
    chat = serving_chat.converted(lambda: body.to_chat(_ITEMS.validate_python(conversation), body.max_output_tokens, session), "input")
    with _renamed(messages="input", max_tokens="max_output_tokens", response_format="text.format", reasoning_effort="reasoning.effort",
                  prompt_cache_key="previous_response_id" if previous else "prompt_cache_key"):
        submitted = await serving_chat.submit(ctx, chat, request, response_id, requested_max_tokens=body.max_output_tokens,
                                              max_tokens_param="max_output_tokens", prompt_param="input")
    turn = Turn(response_id, body, principal, session, input_wire, conversation, submitted, int(time.time()), arrived)
    return turn, submitted.handles


def remember(ctx: ServingContext, store: ResponseStore, turn: Turn, response: dict) -> None:
    """Stores a finished turn (`store: true`). A turn too large for the store says `store:
    false`, and the session named after it goes: no one could ever continue in it."""
    if not turn.body.store:
        return
    conversation = turn.conversation + response["output"]
    record = StoredResponse(turn.id, turn.principal, turn.session_id, response, turn.input_items, conversation)
    if not store.put(record):
        response["store"] = False
        if turn.session_id == turn.id:
            drop_session(ctx, turn.principal, turn.id)


def drop_session(ctx: ServingContext | None, principal: str, session_id: str) -> None:
    """Deletes a session kvserve named after a response (from every tier); one with a turn
    running in it stays, to be evicted like any idle session."""
    if ctx is not None:
        with contextlib.suppress(EntryPinnedError):
            ctx.delete_session(principal, session_id)  # under every model that continued the chain (a LoRA adapter's too)


def hold(store: ResponseStore, turn: Turn, head: dict) -> None:
    """Makes a stored turn retrievable while it runs (`head`: its response `in_progress`)."""
    if turn.body.store:
        store.begin(StoredResponse(turn.id, turn.principal, turn.session_id, head, turn.input_items, []))


async def create(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, request: Request):
    """The turn, answered whole or streamed. Tools kvserve cannot run were dropped: logged, and
    listed in the `X-Kvserve-Dropped-Tools` header."""
    turn, handles = await prepare(ctx, store, body, request)
    headers = body.dropped_tools_header()
    if headers:
        log.warning("%s: dropped tools kvserve cannot run: %s", turn.id, ", ".join(headers.values()))
    if body.stream:
        headers |= await serving.admission_headers(ctx, request, handles)
        return EventSourceResponse(stream(ctx, store, turn, handles[0]), ping=15, headers=headers)
    hold(store, turn, turn.response("in_progress", []))
    try:
        choice = (await serving.collect(ctx, request, handles, ROUTE, turn.submitted.assembly))[0]
        final = choice.final
        response = turn.response(status_of(final, choice.assembly), output_items(choice.assembly, final, summary=turn.summary), final)
        remember(ctx, store, turn, response)
    finally:
        store.abandon(turn.id)  # a failed turn's record; a stored one stays
    return JSONResponse(response, headers=serving.cache_headers(final) | headers)


class Events:
    """Numbers the stream's events (`sequence_number` from 0) and frames them as SSE."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(event, ensure_ascii=False)}


def closed_item(ev: Events, index: int, item: dict) -> list[dict]:
    """The `...done` events of a finished output item."""
    events = []
    common = {"item_id": item["id"], "output_index": index, "content_index": 0}
    if item["type"] == "message":
        part = item["content"][0]
        events += [ev("response.output_text.done", **common, text=part["text"], logprobs=[]), ev("response.content_part.done", **common, part=part)]
    elif item["type"] == "reasoning":
        part = item["content"][0]
        events += [ev("response.reasoning_text.done", **common, text=part["text"]), ev("response.content_part.done", **common, part=part)]
        for i, summary in enumerate(item["summary"]):  # the reasoning as its own summary, sent whole
            at = {"item_id": item["id"], "output_index": index, "summary_index": i}
            events += [ev("response.reasoning_summary_part.added", **at, part={**summary, "text": ""}),
                       ev("response.reasoning_summary_text.delta", **at, delta=summary["text"]),
                       ev("response.reasoning_summary_text.done", **at, text=summary["text"]),
                       ev("response.reasoning_summary_part.done", **at, part=summary)]
    else:
        events.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=item["arguments"]))
    return events + [ev("response.output_item.done", output_index=index, item=item)]


async def stream(ctx: ServingContext, store: ResponseStore, turn: Turn, handle):
    """`event_sequence`, with the turn retrievable `in_progress` from before its id is first sent
    (`response.created`) until it is stored, and its record dropped however the stream ends
    otherwise (failed, client gone)."""
    head = turn.response("in_progress", [])
    hold(store, turn, head)
    try:
        async with contextlib.aclosing(event_sequence(ctx, store, turn, handle, head)) as sequence:
            async for event in sequence:
                yield event
    finally:
        store.abandon(turn.id)


def event_sequence(ctx: ServingContext, store: ResponseStore, turn: Turn, handle, head: dict):
    """The Responses event sequence: created, in_progress, then per output item added /
    content_part.added / deltas / done events, then completed (or incomplete, or failed), through
    the one streaming loop (`serving.stream`).

    Text streams as it comes. A function call (tool_choice required or named: the whole
    output; "auto": an output starting with `<`) is held back and sent whole, arguments in one
    delta, once complete, so a client never sees half a call. The response is stored before
    its final event is sent.
    """
    return serving.stream(ctx, [handle], ROUTE, ResponseEvents(ctx, store, turn, head), arrived=turn.arrived)


class ResponseEvents:
    """The rendering (`serving.Rendering`) of one streamed response: its one choice's outputs
    as output-item events (`Output`), its end as the response's last event."""

    def __init__(self, ctx: ServingContext, store: ResponseStore, turn: Turn, head: dict) -> None:
        self.ctx, self.store, self.turn, self.head = ctx, store, turn, head
        self.ev = Events()
        self.assembly, self.out = turn.submitted.assembly(), Output(self.ev, summary=turn.summary)

    def opening(self) -> list:
        return [self.ev("response.created", response=self.head), self.ev("response.in_progress", response=self.head)]

    def output(self, index: int, output: RequestOutput) -> list:
        return self.out.feed(self.assembly.feed(output))

    def failed(self, output: RequestOutput, error: APIError) -> list:
        events = self.output(0, output)
        # NOTE: `response.error.code` is one of OpenAI's codes (the SDK refuses others), and what
        # fails a stream that has begun is the server's (deadline, memory, engine): server_error,
        # kvserve's own code at the end of the message
        failure = {"code": "server_error", "message": f"{error.message} ({error.code})"}
        return events + [self.ev("response.failed", response=self.turn.response("failed", [], output, failure))]

    def closing(self, finals: list[RequestOutput]) -> list:
        final = finals[0]
        events = self.out.feed(self.assembly.finish(final.finish_reason))
        sent = set(self.out.order)  # items whose `added` event went out
        items = self.out.items(self.assembly, final)
        events += self.out.finish(items, sent)
        response = self.turn.response(status_of(final, self.assembly), items, final)
        remember(self.ctx, self.store, self.turn, response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self.ev(kind, response=response)]


def retrieve(store: ResponseStore, principal: str, response_id: str) -> dict:
    """The stored response, or the one still being generated (`"status": "in_progress"`)."""
    record = store.get(principal, response_id, in_progress=True)
    if record is None:
        raise not_found(response_id, "response_id")
    return record.response


def delete(ctx: ServingContext | None, store: ResponseStore, principal: str, response_id: str) -> dict:
    """Forgets the response. Its KV session (named after the chain's first response) is
    deleted too once no stored response continues in it; a session named by the client's
    `prompt_cache_key` is the client's to delete."""
    record = store.delete(principal, response_id)
    if record is None:
        if store.get(principal, response_id, in_progress=True) is not None:
            raise in_progress(response_id, "response_id")
        raise not_found(response_id, "response_id")
    session = record.session_id
    if session is not None and session.startswith("resp_") and not store.sessions_in_use(principal, session):
        drop_session(ctx, principal, session)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_items(store: ResponseStore, principal: str, response_id: str, query: InputItemsQuery) -> dict:
    """This response's own input items (not the earlier turns'), as a cursor page; a response
    still in progress has them too."""
    record = store.get(principal, response_id, in_progress=True)
    if record is None:
        raise not_found(response_id, "response_id")
    items = record.input_items if query.order == "asc" else record.input_items[::-1]
    if query.after is not None:
        ids = [item["id"] for item in items]
        if query.after not in ids:
            raise APIError(400, f"no input item '{query.after}' in response '{response_id}'", code="invalid_value", param="after")
        items = items[ids.index(query.after) + 1:]
    page = items[: query.limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
