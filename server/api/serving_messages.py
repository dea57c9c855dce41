"""POST /v1/messages and /v1/messages/count_tokens: a Messages turn is a chat turn.

The request becomes a chat request once (`protocol_messages`), is submitted through the chat side
(`serving_chat.submit`: thinking controls, template, limits, grammar, session) and its output is
assembled by the same `Assembly` chat renders (server/api/assembly.py), here as Anthropic's
content blocks: `thinking` (the reasoning, signed), `text`, then one `tool_use` per call. Streamed,
the blocks open and close in that order with Anthropic's event sequence (`Blocks`).

Sessions as chat's: the `X-Session-ID` header or `metadata.session_id` names one; without a name
a resent conversation still reuses the KV of its longest held prefix (anonymous reuse). Usage says
what was reused: `cache_read_input_tokens` are kvserve's cached tokens, `input_tokens` the rest
(Anthropic counts the two apart); the cache is written at no cost, so `cache_creation_input_tokens`
is 0.

A thinking block's `signature` is an HMAC of its text under a key made of the server's API keys
and the served model, bound to the caller's principal: a block that comes back altered, or from
another caller or model, is a 400; servers with the same keys and model (replicas, restarts)
accept each other's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.api import reasoning, serving, serving_chat
from server.api.assembly import Assembly, Parts
from server.api.errors import APIError
from server.api.protocol_messages import CountTokensRequest, MessagesRequest, ThinkingBlock, tool_input
from server.api.serving import ServingContext
from server.engine.sequence import RequestOutput

ROUTE = "/v1/messages"
PING_S = 15


def _signing_key(request: Request, model: str) -> bytes:
    settings = request.app.state.kv.settings
    secret = "\0".join(["kvserve thinking", model, *sorted(settings.api_keys())])
    return hashlib.sha256(secret.encode()).digest()


def signature(request: Request, model: str, thinking: str) -> str:
    """The signature of a thinking block kvserve returns to this caller."""
    message = f"{request.state.principal}\0{thinking}".encode()
    return base64.b64encode(hmac.new(_signing_key(request, model), message, hashlib.sha256).digest()).decode()


def check_signatures(request: Request, ctx: ServingContext, body: MessagesRequest | CountTokensRequest) -> None:
    """400 for a thinking block whose signature is not the one kvserve gave its text."""
    for i, j, block in body.places():
        if isinstance(block, ThinkingBlock) and not hmac.compare_digest(block.signature, signature(request, ctx.model_id, block.thinking)):
            raise APIError(
                400, f"messages[{i}].content[{j}].signature does not match its thinking: send thinking blocks back as "
                "kvserve returned them (signatures are valid on servers with the same API keys and model)",
                code="invalid_value", param=f"messages[{i}].content[{j}].signature", rejection="bad_request",
            )


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def stop_reason(assembly: Assembly, final: RequestOutput) -> str:
    if assembly.finish_reason == "tool_calls":
        return "tool_use"
    if assembly.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if final.stop is not None else "end_turn"


class Turn:
    """One POST /v1/messages being answered: the message object around its content blocks."""

    def __init__(self, turn_id: str, request: Request, ctx: ServingContext, body: MessagesRequest, submitted: serving_chat.Submitted,
                 arrived: float) -> None:
        self.id, self.request, self.ctx, self.body, self.submitted, self.arrived = turn_id, request, ctx, body, submitted, arrived

    def sign(self, thinking: str) -> str:
        return signature(self.request, self.ctx.model_id, thinking)

    def message(self, content: list[dict], final: RequestOutput | None, cached: int, assembly: Assembly | None = None) -> dict:
        """The message object (Anthropic's field order); `final` None: the head of a stream."""
        done = final is not None and assembly is not None
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": content,
            "stop_reason": stop_reason(assembly, final) if done else None,
            "stop_sequence": final.stop if done else None,
            "usage": usage(self.submitted.prompt_tokens, cached, final.completion_tokens if final is not None else 0),
        }

    def blocks(self, assembly: Assembly) -> list[dict]:
        """A finished assembly's content blocks: its thinking, text, calls."""
        out = []
        if assembly.thinking and assembly.reasoning:
            shown = "" if self.body.omits_thinking else assembly.reasoning
            out.append({"type": "thinking", "thinking": shown, "signature": self.sign(shown)})
        if assembly.content or not assembly.calls:
            out.append({"type": "text", "text": assembly.content})
        out += [{"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)} for call in assembly.calls]
        return out


async def submit(ctx: ServingContext, body: MessagesRequest, request: Request) -> Turn:
    arrived = time.monotonic()
    ctx.check_model(body.model)
    check_signatures(request, ctx, body)
    chat = serving_chat.converted(body.chat, "messages")
    turn_id = f"msg_{uuid.uuid4().hex}"
    submitted = await serving_chat.submit(ctx, chat, request, turn_id, requested_max_tokens=body.max_tokens, continue_final=body.prefilled)
    return Turn(turn_id, request, ctx, body, submitted, arrived)


async def create(ctx: ServingContext, body: MessagesRequest, request: Request):
    """The turn, answered whole or streamed. Server tools kvserve cannot run were dropped and
    are named in the `X-Kvserve-Dropped-Tools` header."""
    turn = await submit(ctx, body, request)
    handles = turn.submitted.handles
    headers = body.dropped_tools_header() | {"request-id": turn.id}
    if body.stream:
        headers |= await serving.admission_headers(ctx, request, handles)
        cached = handles[0].admission.cached_tokens
        events = serving.stream(ctx, handles, ROUTE, MessageEvents(turn, cached), arrived=turn.arrived)
        return EventSourceResponse(events, ping=PING_S, ping_message_factory=_ping, headers=headers)
    choice = (await serving.collect(ctx, request, handles, ROUTE, turn.submitted.assembly))[0]
    final = choice.final
    message = turn.message(turn.blocks(choice.assembly), final, final.cached_tokens, choice.assembly)
    return JSONResponse(message, headers=serving.cache_headers(final) | headers)


async def count_tokens(ctx: ServingContext, body: CountTokensRequest, request: Request) -> dict:
    """The conversation's input tokens, counted as /v1/messages would render it."""
    ctx.check_model(body.model)
    check_signatures(request, ctx, body)
    chat = serving_chat.converted(body.to_chat, "messages")
    template_kwargs, _ = reasoning.controls(ctx, chat.reasoning_effort, None, None)
    ids, _ = await serving_chat.prompt(ctx, chat, template_kwargs, bounded=False, continue_final=body.prefilled)
    return {"input_tokens": len(ids)}


def _ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))


def event(kind: str, **fields) -> dict:
    """One server-sent event of Anthropic's stream: named, its data carrying its `type`."""
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}


class Blocks:
    """A streamed turn's content blocks, opened and closed in order as its parts come (one
    block open at a time, as Anthropic streams): thinking, text, then each call's tool_use with
    its arguments as `input_json_delta`s. A thinking block closes with its signature."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.index = -1  # the open block's (or the last closed one's)
        self.kind: str | None = None  # the open block's type
        self.thinking = ""  # the open thinking block's text (signed when it closes)
        self.calls: set[int] = set()  # indices of the calls whose block opened

    def _close(self) -> list[dict]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(event("content_block_delta", index=self.index, delta={"type": "signature_delta", "signature": self.turn.sign(self.thinking)}))
        self.kind = None
        return events + [event("content_block_stop", index=self.index)]

    def _open(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self.index += 1
        self.kind = kind
        return events + [event("content_block_start", index=self.index, content_block=block)]

    def feed(self, parts: Parts) -> list[dict]:
        events = []
        if parts.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.thinking = ""
            if not self.turn.body.omits_thinking:
                self.thinking += parts.reasoning
                events.append(event("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": parts.reasoning}))
        if parts.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": parts.content}))
        started = {call.index: call for call in parts.started}
        for index in sorted(set(started) | set(parts.arguments)):
            if index in started:
                call = started[index]
                events += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                self.calls.add(index)
            if parts.arguments.get(index):
                events.append(event("content_block_delta", index=self.index, delta={"type": "input_json_delta", "partial_json": parts.arguments[index]}))
        return events

    def finish(self, assembly: Assembly) -> list[dict]:
        """The last blocks: a turn that made no block gets an empty text block (as `Turn.blocks`)."""
        events = []
        if self.index < 0 and not assembly.calls:
            events += self._open("text", {"type": "text", "text": ""})
        return events + self._close()


class MessageEvents:
    """The rendering (`serving.Rendering`) of one streamed turn: message_start and a ping, the
    content blocks' events, then message_delta (stop reason, usage) and message_stop; a failure
    is Anthropic's `error` event."""

    def __init__(self, turn: Turn, cached: int) -> None:
        self.turn, self.cached = turn, cached
        self.assembly = turn.submitted.assembly()
        self.blocks = Blocks(turn)

    def opening(self) -> list:
        return [event("message_start", message=self.turn.message([], None, self.cached)), event("ping")]

    def output(self, index: int, output: RequestOutput) -> list:
        return self.blocks.feed(self.assembly.feed(output))

    def failed(self, output: RequestOutput, error: APIError) -> list:
        return self.output(0, output) + [{"event": "error", "data": json.dumps(error.anthropic_body())}]

    def closing(self, finals: list[RequestOutput]) -> list:
        final = finals[0]
        events = self.blocks.feed(self.assembly.finish(final.finish_reason)) + self.blocks.finish(self.assembly)
        delta = {"stop_reason": stop_reason(self.assembly, final), "stop_sequence": final.stop}
        events.append(event("message_delta", delta=delta, usage=usage(self.turn.submitted.prompt_tokens, final.cached_tokens, final.completion_tokens)))
        return events + [event("message_stop")]
