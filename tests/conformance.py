"""Conformance of what kvserve sends (issue 53 item 4): every chat chunk, completion, Responses
event and Messages event, streamed or not, parsed strictly by the official SDKs' own typed models
(`strict`: the JSON validated in pydantic's strict mode, and every key the model does not declare
refused unless `ALLOWED_EXTRA` lists it), with each stream's sequence rules checked. The SDKs'
models allow extra fields and their clients `construct` without validating, so a field kvserve
invents, misspells or omits would otherwise pass every client test unseen.

`Recorder` wraps an ASGI app and checks each response of the four generation routes as it is
sent; the per-route functions (`chat_completion`, `chat_stream`, `completion`, `completion_stream`,
`response`, `response_stream`, `message`, `message_stream`) check payloads given to them. Each
returns a list of violations, each naming the route, what is wrong and an excerpt.
"""

from __future__ import annotations

import json
import typing

import pydantic
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject

# kvserve's extensions, as "SDK model.key": keys a model does not declare that kvserve sends on
# purpose, wherever that model appears. Anything else undeclared is a violation.
ALLOWED_EXTRA = frozenset({
    # a thinking model's reasoning under both names vLLM gives it and clients read:
    # `reasoning_content` (its first) and `reasoning` (its newer) (server/api/assembly.py `message`,
    # server/api/serving_chat.py `deltas`)
    "ChatCompletionMessage.reasoning_content", "ChatCompletionMessage.reasoning",
    "ChoiceDelta.reasoning_content", "ChoiceDelta.reasoning",
    # OpenAI's API returns `store` in every response object, but the SDK's model lacks it;
    # kvserve says false there when a response was too large to store (docs/guides/responses.md)
    "Response.store",
    # OpenAI's API reference has the call's `name` in this event, but the SDK's model lacks it
    "ResponseFunctionCallArgumentsDoneEvent.name",
})


class CompletionChunkChoice(CompletionChoice):
    """A streamed completion's choice. OpenAI sends `finish_reason` null until the choice's last
    chunk, and the SDK parses chunks as `Completion`, whose finish_reason is not nullable: the
    one SDK model relaxed here."""

    finish_reason: typing.Optional[CompletionChoice.model_fields["finish_reason"].annotation]


class CompletionChunk(Completion):
    choices: typing.List[CompletionChunkChoice]


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
HEAD = ("id", "created", "model", "system_fingerprint")  # the same in every chunk of a stream
TERMINAL = {"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}


# -- strict typed parsing ------------------------------------------------------------------------

def strict(model_type, obj, allowed_extra: frozenset[str] = ALLOWED_EXTRA) -> tuple[object | None, list[str]]:
    """`obj` (parsed JSON) validated by the SDK type `model_type` (a model, or a union of them
    told apart by their `type`), in pydantic's strict JSON mode: a missing required field or a
    value of the wrong type fails. Then every key a model in it does not declare, unless
    `allowed_extra` lists it ("Model.key"). Returns (the parsed model or None, the problems)."""
    member = _member(model_type, obj)
    if member is None:
        return None, [f"an unknown event type {obj.get('type') if isinstance(obj, dict) else obj!r}"]
    try:
        parsed = member.model_validate_json(json.dumps(obj), strict=True)
    except pydantic.ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors()[:4])
        return None, [f"not a valid {member.__name__}: {errors}"]
    return parsed, [f"undeclared field {path} (not in {owner})" for owner, path in undeclared(parsed, obj)
                    if f"{owner}.{path.rpartition('.')[2]}" not in allowed_extra]


def undeclared(parsed, raw, path: str = "") -> list[tuple[str, str]]:
    """(model name, path) of each key in `raw` that the parsed model, or the model in it that
    holds the key, does not declare."""
    if isinstance(parsed, pydantic.BaseModel) and isinstance(raw, dict):
        fields = {(field.alias or name): name for name, field in type(parsed).model_fields.items()}
        out = []
        for key, value in raw.items():
            at = f"{path}.{key}" if path else key
            if key in fields:
                out += undeclared(getattr(parsed, fields[key]), value, at)
            else:
                out.append((type(parsed).__name__, at))
        return out
    if isinstance(parsed, list) and isinstance(raw, list):
        return [p for item, value in zip(parsed, raw) for p in undeclared(item, value, path + "[]")]
    if isinstance(parsed, dict) and isinstance(raw, dict):
        return [p for key, value in raw.items() if key in parsed for p in undeclared(parsed[key], value, path + ".*")]
    return []


def _member(model_type, obj) -> type[pydantic.BaseModel] | None:
    """`model_type` itself, or for a union of SDK models (`ResponseStreamEvent`,
    `RawMessageStreamEvent`) its member whose `type` literal is `obj`'s, None if none is. The
    SDKs mark their unions' discriminator with metadata of their own, which pydantic does not
    read: validated as a plain union, a wrong event would list every member's errors."""
    if isinstance(model_type, type):
        return model_type
    union = typing.get_args(model_type)[0] if typing.get_origin(model_type) is typing.Annotated else model_type
    kind = obj.get("type") if isinstance(obj, dict) else None
    return next((m for m in typing.get_args(union) if kind in typing.get_args(m.model_fields["type"].annotation)), None)


class Problems(list):
    """The violations found in one response, each prefixed with where it was found."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def add(self, what: str, excerpt=None) -> None:
        self.append(f"{self.where}: {what}" + ("" if excerpt is None else f" -- {_excerpt(excerpt)}"))

    def typed(self, model_type, obj, at: str):
        """`obj` parsed by `strict`; None when it is not valid."""
        parsed, found = strict(model_type, obj)
        for problem in found:
            self.add(f"{at}: {problem}", obj)
        return parsed


def _excerpt(obj, limit: int = 240) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def openai_error(obj, p: Problems, at: str) -> None:
    """OpenAI's error: `{"error": {"message", "type", "param", "code"}}`, the SDK's ErrorObject,
    a message said."""
    error = obj.get("error") if isinstance(obj, dict) else None
    if set(obj) != {"error"} or not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} or not error["message"]:
        p.add(f"{at}: not OpenAI's error shape {{'error': {{message, type, param, code}}}}", obj)
    else:
        p.typed(ErrorObject, error, at)


def anthropic_error(obj, p: Problems, at: str) -> None:
    """Anthropic's error: `{"type": "error", "error": {"type", "message"}}`, the SDK's ErrorResponse."""
    error = obj.get("error") if isinstance(obj, dict) else None
    if set(obj) != {"type", "error"} or not isinstance(error, dict) or set(error) != {"type", "message"}:
        p.add(f"{at}: not Anthropic's error shape {{'type': 'error', 'error': {{type, message}}}}", obj)
    else:
        p.typed(ErrorResponse, obj, at)


# -- chat completions ----------------------------------------------------------------------------

def chat_completion(obj: dict, request: dict | None = None, where: str = "POST /v1/chat/completions") -> list[str]:
    """A chat.completion: strictly typed; a choice per `n`; logprobs when asked; a "tool_calls"
    finish with calls whose arguments are JSON objects; both reasoning names equal."""
    p = Problems(where)
    request = request or {}
    if p.typed(ChatCompletion, obj, "chat.completion") is None:
        return p
    n = request.get("n") or 1
    if [c["index"] for c in obj["choices"]] != list(range(n)):
        p.add(f"choice indices {[c['index'] for c in obj['choices']]}, expected 0..{n - 1}")
    for choice in obj["choices"]:
        message, at = choice["message"], f"choice {choice['index']}"
        if (choice.get("logprobs") is not None) != bool(request.get("logprobs")):
            p.add(f"{at}: logprobs {'missing' if request.get('logprobs') else 'not asked for'}", choice.get("logprobs"))
        if not _same_reasoning(message):
            p.add(f"{at}: reasoning and reasoning_content differ", message)
        if choice["finish_reason"] == "tool_calls":
            if not message.get("tool_calls"):
                p.add(f"{at}: finish_reason tool_calls without tool_calls", message)
            for call in message.get("tool_calls") or []:
                if not _json_object(call["function"]["arguments"]):
                    p.add(f"{at}: a finished call's arguments are not a JSON object", call)
    return p


def _same_reasoning(message: dict) -> bool:
    """kvserve sends the reasoning under both names or neither, the same text."""
    return ("reasoning" in message) == ("reasoning_content" in message) and message.get("reasoning") == message.get("reasoning_content")


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _chunks(payloads: list, p: Problems) -> tuple[list[dict], bool]:
    """The chunks of a chat or completions stream before its end, and whether it ended with
    `[DONE]` (False: it ended with an error object, checked here, or not at all)."""
    for i, payload in enumerate(payloads):
        if payload == "[DONE]" or (isinstance(payload, dict) and "error" in payload):
            if i != len(payloads) - 1:
                p.add(f"data after {'[DONE]' if payload == '[DONE]' else 'the error object'}", payloads[i + 1])
            if payload != "[DONE]":
                openai_error(payload, p, f"chunk {i}")
            return payloads[:i], payload == "[DONE]"
    p.add("the stream does not end with data: [DONE]", payloads[-1] if payloads else None)
    return payloads, False


def _stream_usage(chunks: list[dict], k: int, include_usage: bool, p: Problems) -> bool:
    """Usage rules of chunk `k`: with include_usage, `usage` null on every chunk but the one
    final chunk without choices; without, no usage. True for the usage chunk."""
    chunk, at = chunks[k], f"chunk {k}"
    if not include_usage:
        if chunk.get("usage") is not None or not chunk["choices"]:
            p.add(f"{at}: usage or an empty choices list without stream_options.include_usage", chunk)
        return False
    if "usage" not in chunk:
        p.add(f"{at}: no usage key (null before the last chunk) with stream_options.include_usage", chunk)
    if chunk["choices"]:
        if chunk.get("usage") is not None:
            p.add(f"{at}: usage on a chunk with choices", chunk)
        return False
    if chunk.get("usage") is None or k != len(chunks) - 1:
        p.add(f"{at}: the usage chunk must be the last one, with usage", chunk)
    return True


class _ChatChoice:
    """One choice of a chat stream as its deltas come."""

    def __init__(self) -> None:
        self.deltas = 0
        self.content = ""
        self.reasoning: str | None = None
        self.calls: list[dict] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None

    def feed(self, choice: dict, at: str, p: Problems) -> None:
        delta = choice["delta"]
        if self.finish_reason is not None:
            p.add(f"{at}: a delta for choice {choice['index']} after its finish_reason", choice)
        if self.deltas == 0 and delta.get("role") != "assistant":
            p.add(f"{at}: the first delta of choice {choice['index']} has no role", choice)
        elif self.deltas and delta.get("role") is not None:
            p.add(f"{at}: role repeated after the first delta", choice)
        self.deltas += 1
        reasoning = delta.get("reasoning_content")
        if not _same_reasoning(delta):
            p.add(f"{at}: reasoning and reasoning_content differ", delta)
        if reasoning:
            if self.content:
                p.add(f"{at}: reasoning after the content started", delta)
            self.reasoning = (self.reasoning or "") + reasoning
        self.content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            self._call(call, at, p)
        self.logprobs += (choice.get("logprobs") or {}).get("content") or []
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _call(self, call: dict, at: str, p: Problems) -> None:
        fn = call.get("function") or {}
        if call["index"] == len(self.calls):
            if not call.get("id") or call.get("type") != "function" or not fn.get("name"):
                p.add(f"{at}: the first delta of tool call {call['index']} lacks its id, type or name", call)
            function = {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}
            self.calls.append({"id": call.get("id"), "type": "function", "function": function})
        elif call["index"] == len(self.calls) - 1:
            if call.get("id") or call.get("type") or fn.get("name"):
                p.add(f"{at}: a later delta of tool call {call['index']} repeats its id, type or name", call)
            self.calls[-1]["function"]["arguments"] += fn.get("arguments") or ""
        else:
            p.add(f"{at}: tool call index {call['index']} out of order ({len(self.calls)} started)", call)

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.content or (None if self.calls else ""), "refusal": None}
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = self.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def _walk_chunks(payloads: list, request: dict, chunk_type, feed, p: Problems) -> tuple[dict | None, dict | None]:
    """The chunks of a chat or completions stream, each strictly `chunk_type` with the first
    chunk's head, usage as `stream_options` says; `feed(choice, at)` takes each choice. Returns
    the head (None when the stream did not end with `[DONE]` or held no valid chunk) and the
    usage chunk's usage."""
    include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
    chunks, done = _chunks(payloads, p)
    head, usage = None, None
    for k, chunk in enumerate(chunks):
        at = f"chunk {k}"
        if p.typed(chunk_type, chunk, at) is None:
            continue
        ident = {f: chunk.get(f) for f in HEAD}
        head = head or ident
        if ident != head:
            p.add(f"{at}: id, created, model or system_fingerprint differ from the first chunk's {head}", chunk)
        if _stream_usage(chunks, k, include_usage, p):
            usage = chunk.get("usage")
        for choice in chunk["choices"]:
            feed(choice, at)
    if done and head is not None and include_usage and usage is None:
        p.add("no usage chunk with stream_options.include_usage")
    return (head if done else None), usage


def chat_stream(payloads: list, request: dict | None = None) -> list[str]:
    """A chat stream: each chunk a strict ChatCompletionChunk with the same id, created, model
    and fingerprint; per choice the role first, reasoning before content, each tool call opened
    once (index, id, name) then only its arguments, one finish_reason and nothing after; usage
    as stream_options says; `[DONE]` last. The deltas joined are a valid chat.completion."""
    p = Problems("POST /v1/chat/completions (stream)")
    request = request or {}
    choices: dict[int, _ChatChoice] = {}

    def feed(choice: dict, at: str) -> None:
        choices.setdefault(choice["index"], _ChatChoice()).feed(choice, at, p)

    head, usage = _walk_chunks(payloads, request, ChatCompletionChunk, feed, p)
    if head is None:
        return p
    for index, choice in choices.items():
        if choice.finish_reason is None:
            p.add(f"choice {index} never got a finish_reason")
    assembled = {
        **head, "object": "chat.completion",
        "choices": [{"index": i, "message": c.message(), "logprobs": {"content": c.logprobs, "refusal": None} if request.get("logprobs") else None,
                     "finish_reason": c.finish_reason} for i, c in sorted(choices.items())],
        **({"usage": usage} if usage is not None else {}),
    }
    return p + chat_completion(assembled, request, "POST /v1/chat/completions (stream, its deltas joined)")


# -- completions ---------------------------------------------------------------------------------

def _prompts(request: dict) -> int:
    prompt = request.get("prompt", "")
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def completion(obj: dict, request: dict | None = None, where: str = "POST /v1/completions") -> list[str]:
    """A text_completion: strictly typed; a choice per prompt and `n`; logprobs when asked."""
    p = Problems(where)
    request = request or {}
    if p.typed(Completion, obj, "text_completion") is None:
        return p
    count = _prompts(request) * (request.get("n") or 1)
    if [c["index"] for c in obj["choices"]] != list(range(count)):
        p.add(f"choice indices {[c['index'] for c in obj['choices']]}, expected 0..{count - 1}")
    for choice in obj["choices"]:
        if (choice.get("logprobs") is not None) != (request.get("logprobs") is not None):
            p.add(f"choice {choice['index']}: logprobs {'missing' if request.get('logprobs') is not None else 'not asked for'}")
    return p


def completion_stream(payloads: list, request: dict | None = None) -> list[str]:
    """A completions stream: strict Completion chunks with the same head, one finish_reason per
    choice and nothing after it, usage as stream_options says, `[DONE]` last; joined, a valid
    text_completion."""
    p = Problems("POST /v1/completions (stream)")
    request = request or {}
    choices: dict[int, dict] = {}

    def feed(choice: dict, at: str) -> None:
        joined = choices.setdefault(choice["index"], {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": None})
        if joined["finish_reason"] is not None:
            p.add(f"{at}: text for choice {choice['index']} after its finish_reason", choice)
        joined["text"] += choice["text"]
        if choice.get("logprobs") is not None:
            joined["logprobs"] = {key: (joined["logprobs"] or {}).get(key, []) + value for key, value in choice["logprobs"].items()}
        joined["finish_reason"] = choice.get("finish_reason") or joined["finish_reason"]

    head, usage = _walk_chunks(payloads, request, CompletionChunk, feed, p)
    if head is None:
        return p
    for index, choice in choices.items():
        if choice["finish_reason"] is None:
            p.add(f"choice {index} never got a finish_reason")
    assembled = {**head, "object": "text_completion", "choices": [c for _, c in sorted(choices.items())], **({"usage": usage} if usage else {})}
    return p + completion(assembled, request, "POST /v1/completions (stream, its chunks joined)")


# -- the Responses API ---------------------------------------------------------------------------

def _response_rules(obj: dict, p: Problems, at: str) -> None:
    """A response's status agrees with its details: incomplete_details only when incomplete,
    an error only when failed."""
    status = obj.get("status")
    if (obj.get("incomplete_details") is not None) != (status == "incomplete"):
        p.add(f"{at}: status {status} with incomplete_details {obj.get('incomplete_details')}")
    if (obj.get("error") is not None) != (status == "failed"):
        p.add(f"{at}: status {status} with error {obj.get('error')}")


def response(obj: dict, request: dict | None = None) -> list[str]:
    """A response object: strictly typed, its status consistent with its details."""
    p = Problems("POST /v1/responses")
    if p.typed(Response, obj, "response") is not None:
        _response_rules(obj, p, "response")
    return p


class _OpenItem:
    """The output item open in a Responses stream, and what its events said of it so far."""

    PARTS = {"response.content_part": ("content", "content_index"), "response.reasoning_summary_part": ("summary", "summary_index")}
    TEXTS = {"response.output_text": ("content", "content_index", "output_text"),
             "response.reasoning_text": ("content", "content_index", "reasoning_text"),
             "response.reasoning_summary_text": ("summary", "summary_index", "summary_text")}

    def __init__(self, index: int, item: dict) -> None:
        self.index, self.id, self.type, self.name = index, item.get("id"), item.get("type"), item.get("name")
        self.parts: dict[str, list[dict]] = {"content": [], "summary": []}  # each part: type, text, text_done
        self.open: tuple[str, int] | None = None
        self.arguments: str | None = None  # the function call's arguments (None: no delta yet)
        self.arguments_done = False

    def event(self, kind: str, e: dict, p: Problems, at: str) -> None:
        base, _, what = kind.rpartition(".")
        if base in self.PARTS:
            group, key = self.PARTS[base]
            self._part(group, e[key], what, e["part"], p, at)
        elif base in self.TEXTS:
            group, key, part_type = self.TEXTS[base]
            if self.open != (group, e[key]) or self.parts[group][e[key]]["type"] != part_type:
                p.add(f"{at}: names {group} part {e[key]}, not the open {part_type} part {self.open}")
                return
            part = self.parts[group][e[key]]
            if what == "delta":
                part["text"] += e["delta"]
            else:
                part["text_done"] = True
                if e["text"] != part["text"]:
                    p.add(f"{at}: its text differs from its deltas joined {_excerpt(part['text'])!r}", e)
        elif base == "response.function_call_arguments":
            if self.type != "function_call":
                p.add(f"{at}: arguments of a {self.type} item", e)
            elif what == "delta":
                self.arguments = (self.arguments or "") + e["delta"]
            else:
                self.arguments_done = True
                if e["arguments"] != (self.arguments or ""):
                    p.add(f"{at}: its arguments differ from the deltas joined {_excerpt(self.arguments or '')!r}", e)
                if e.get("name") not in (None, self.name):
                    p.add(f"{at}: its name differs from the item's {self.name!r}", e)
        else:
            p.add(f"{at}: an event of an output item this check does not know", e)

    def _part(self, group: str, index: int, what: str, part: dict, p: Problems, at: str) -> None:
        parts = self.parts[group]
        if what == "added":
            if self.open is not None:
                p.add(f"{at}: {group} part {index} opened before part {self.open} closed")
            if index != len(parts):
                p.add(f"{at}: {group} part {index} opened, expected {len(parts)}")
            if part.get("text"):
                p.add(f"{at}: a part opened with text", part)
            parts.append({"type": part.get("type"), "text": "", "text_done": False})
            self.open = (group, len(parts) - 1)
        elif self.open != (group, index):
            p.add(f"{at}: closes {group} part {index}, but the open one is {self.open}")
        else:
            if part.get("type") != parts[index]["type"] or part.get("text") != parts[index]["text"]:
                p.add(f"{at}: the part differs from what its deltas said {parts[index]}", part)
            if not parts[index]["text_done"]:
                p.add(f"{at}: the part closed before its text's done event")
            self.open = None

    def close(self, item: dict, p: Problems, at: str) -> None:
        """The item's `output_item.done`: what it holds is what the events streamed."""
        if self.open is not None:
            p.add(f"{at}: the item closed with its part {self.open} open")
        if item.get("type") != self.type:
            p.add(f"{at}: the item's type changed from {self.type}", item)
        if self.type == "function_call":
            if item.get("arguments") != (self.arguments or "") or not self.arguments_done:
                p.add(f"{at}: the call's arguments differ from its argument events", item)
            return
        for group in ("content", "summary"):
            streamed = [(part["type"], part["text"]) for part in self.parts[group]]
            held = [(part.get("type"), part.get("text")) for part in item.get(group) or []]
            if streamed != held:
                p.add(f"{at}: the item's {group} differs from its parts streamed {streamed}", item)


def response_stream(events: list[dict], request: dict | None = None) -> list[str]:
    """A Responses stream: each event a strict ResponseStreamEvent; sequence_number 0, 1, ...;
    created, in_progress first, one of completed / incomplete / failed last, with the status it
    names and the same response id throughout; output items opened (output_index 0, 1, ...) and
    closed one at a time, their parts likewise inside them, each delta naming the open item and
    part, each `done` text its deltas joined, each done item what its events said, and the final
    response's output those items. A stream ending with `error` or `response.failed` is checked
    up to there."""
    p = Problems("POST /v1/responses (stream)")
    items: list[dict] = []  # the items closed so far
    item: _OpenItem | None = None
    rid, final, ended = None, None, None
    for k, e in enumerate(events):
        kind = e.get("type")
        at = f"event {k} ({kind})"
        if e.get("sequence_number") != k:
            p.add(f"{at}: sequence_number {e.get('sequence_number')}, expected {k}")
        if ended is not None:
            p.add(f"{at}: an event after {ended}")
            continue
        if (k, kind) != (0, "response.created") and (k == 0 or kind == "response.created"):
            p.add(f"{at}: the stream must start with response.created")
        if (k, kind) != (1, "response.in_progress") and (k == 1 or kind == "response.in_progress"):
            p.add(f"{at}: response.in_progress must follow response.created")
        if kind == "error" or kind in TERMINAL:
            ended, final = kind, e.get("response")
        if p.typed(ResponseStreamEvent, e, at) is None:
            continue
        if "response" in e:
            rid = rid or e["response"]["id"]
            if e["response"]["id"] != rid:
                p.add(f"{at}: response id {e['response']['id']}, not {rid}")
            status = TERMINAL.get(kind, "in_progress")
            if e["response"]["status"] != status:
                p.add(f"{at}: response status {e['response']['status']}, expected {status}")
            _response_rules(e["response"], p, at)
        if "response" in e or kind == "error":
            continue
        if kind == "response.output_item.added":
            if item is not None:
                p.add(f"{at}: item {e['output_index']} opened before item {item.index} closed", e)
            if e["output_index"] != len(items):
                p.add(f"{at}: output_index {e['output_index']}, expected {len(items)}", e)
            if e["item"].get("status") != "in_progress":
                p.add(f"{at}: an item opened with status {e['item'].get('status')}", e)
            item = _OpenItem(e["output_index"], e["item"])
        elif kind == "response.output_item.done":
            if item is None or (e["output_index"], e["item"].get("id")) != (item.index, item.id):
                p.add(f"{at}: closes an item that is not the open one", e)
            else:
                item.close(e["item"], p, at)
            items.append(e["item"])
            item = None
        elif item is None or (e.get("output_index"), e.get("item_id")) != (item.index, item.id):
            p.add(f"{at}: names item {e.get('output_index')} {e.get('item_id')}, but the open item is {item and (item.index, item.id)}", e)
        else:
            item.event(kind, e, p, at)
    if ended is None:
        p.add("the stream ended without response.completed, response.incomplete or response.failed")
    elif ended in ("response.completed", "response.incomplete"):
        if item is not None:
            p.add(f"item {item.index} never closed")
        if (final or {}).get("output") != items:
            p.add(f"the final response's output differs from the output_item.done items {_excerpt(items)}", final)
    return p


# -- the Messages API ----------------------------------------------------------------------------

DELTA_BLOCK = {"text_delta": "text", "input_json_delta": "tool_use", "thinking_delta": "thinking", "signature_delta": "thinking"}


def message(obj: dict, request: dict | None = None, where: str = "POST /v1/messages") -> list[str]:
    """A message: strictly typed; a tool_use stop with tool_use blocks; stop_sequence set
    exactly when a stop sequence stopped it; thinking blocks signed."""
    p = Problems(where)
    if p.typed(Message, obj, "message") is None:
        return p
    kinds = [block["type"] for block in obj["content"]]
    if obj["stop_reason"] == "tool_use" and "tool_use" not in kinds:
        p.add("stop_reason tool_use without a tool_use block", obj["content"])
    if (obj["stop_sequence"] is not None) != (obj["stop_reason"] == "stop_sequence"):
        p.add(f"stop_sequence {obj['stop_sequence']!r} with stop_reason {obj['stop_reason']}")
    for block in obj["content"]:
        if block["type"] == "thinking" and not block["signature"]:
            p.add("a thinking block without its signature", block)
    return p


def message_stream(events: list[dict], request: dict | None = None) -> list[str]:
    """A Messages stream: each event a strict RawMessageStreamEvent (or a bare ping);
    message_start first; content blocks 0, 1, ... each started, given deltas of its own kind
    and stopped before the next starts (a tool_use block's JSON joined parses, unless max_tokens
    cut the last one short); one message_delta right before message_stop, last. What they add up
    to is a valid message. A stream ending with an `error` event is checked up to there."""
    p = Problems("POST /v1/messages (stream)")
    start, blocks, partial, open_, delta, last, stopped = None, [], {}, None, None, None, False
    for k, e in enumerate(events):
        kind = e.get("type")
        at = f"event {k} ({kind})"
        if stopped:
            p.add(f"{at}: an event after message_stop")
        if kind == "ping":
            if e != {"type": "ping"}:
                p.add(f"{at}: a ping with fields", e)
            continue
        if kind == "error":
            anthropic_error(e, p, at)
            if k != len(events) - 1:
                p.add(f"{at}: events after the error")
            return p
        if (k == 0) != (kind == "message_start"):
            p.add(f"{at}: the stream must start with message_start, once")
        if delta is not None and kind != "message_stop":
            p.add(f"{at}: only message_stop may follow message_delta")
        if p.typed(RawMessageStreamEvent, e, at) is None:
            continue
        if kind == "message_start":
            start = e["message"]
            if start["content"] or start["stop_reason"] is not None:
                p.add(f"{at}: the message starts with content or a stop_reason", start)
        elif kind == "content_block_start":
            if open_ is not None:
                p.add(f"{at}: block {e['index']} started before block {open_} stopped")
            if e["index"] != len(blocks):
                p.add(f"{at}: block index {e['index']}, expected {len(blocks)}")
            blocks.append(dict(e["content_block"]))
            open_, partial[len(blocks) - 1] = len(blocks) - 1, ""
        elif kind == "content_block_delta":
            if e["index"] != open_:
                p.add(f"{at}: a delta for block {e['index']}, but the open block is {open_}")
                continue
            block, d = blocks[open_], e["delta"]
            if DELTA_BLOCK.get(d["type"]) != block["type"]:
                p.add(f"{at}: a {d['type']} in a {block['type']} block")
            elif d["type"] == "input_json_delta":
                partial[open_] += d["partial_json"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            else:  # text_delta, thinking_delta
                field = d["type"].removesuffix("_delta")
                block[field] += d[field]
        elif kind == "content_block_stop":
            if e["index"] != open_:
                p.add(f"{at}: stops block {e['index']}, but the open block is {open_}")
                continue
            if blocks[open_]["type"] == "tool_use" and _json_object(partial[open_]):
                blocks[open_]["input"] = json.loads(partial[open_])
            open_ = None
        elif kind == "message_delta":
            if open_ is not None:
                p.add(f"{at}: message_delta while block {open_} is open")
            if delta is not None:
                p.add(f"{at}: a second message_delta")
            delta = e
        elif kind == "message_stop":
            if delta is None or last is not delta:
                p.add(f"{at}: message_stop does not follow message_delta")
            stopped = True
        last = e
    if not stopped:
        p.add("the stream ended without message_stop")
    if start is None or delta is None or not stopped:
        return p
    for index, block in enumerate(blocks):  # only max_tokens may cut the last call short
        cut = index == len(blocks) - 1 and delta["delta"].get("stop_reason") == "max_tokens"
        if block["type"] == "tool_use" and partial[index] and not _json_object(partial[index]) and not cut:
            p.add(f"block {index}: the tool_use input joined is not a JSON object", partial[index])
    usage = {**start["usage"], **{key: value for key, value in delta["usage"].items() if value is not None}}
    assembled = {**start, "content": blocks, **delta["delta"], "usage": usage}
    return p + message(assembled, request, "POST /v1/messages (stream, its events joined)")


# -- whole HTTP responses ------------------------------------------------------------------------

JSON_CHECKS = {"/v1/chat/completions": chat_completion, "/v1/completions": completion, "/v1/responses": response, "/v1/messages": message}
STREAM_CHECKS = {"/v1/chat/completions": chat_stream, "/v1/completions": completion_stream, "/v1/responses": response_stream,
                 "/v1/messages": message_stream}


def sse_frames(body: bytes | str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each server-sent event; comments (`: ping`) skipped."""
    text = body.decode() if isinstance(body, bytes) else body
    frames = []
    for block in text.replace("\r\n", "\n").replace("\r", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            frames.append((name, "\n".join(data)))
    return frames


def check_exchange(route: str, request: dict, status: int, content_type: str, body: bytes) -> list[str]:
    """The violations of one response (200s only) of a generation route: its JSON, or its
    server-sent events with each one's name the `type` its data carries (none for chat's and
    completions')."""
    if status != 200 or route not in ROUTES:
        return []
    streamed = content_type.startswith("text/event-stream")
    p = Problems(f"POST {route}")
    if streamed != bool(request.get("stream")):
        p.add(f"stream {request.get('stream')!r} answered as {content_type}")
    if not streamed:
        try:
            obj = json.loads(body)
        except ValueError:
            p.add(f"not JSON ({content_type})", body.decode(errors="replace"))
            return p
        return p + JSON_CHECKS[route](obj, request)
    payloads = []
    named = route in ("/v1/responses", "/v1/messages")
    for name, data in sse_frames(body):
        try:
            payload = data if data == "[DONE]" and not named else json.loads(data)
        except ValueError:
            p.add("an event whose data is not JSON", data)
            continue
        if named and name != (payload.get("type") if isinstance(payload, dict) else None):
            p.add(f"an event named {name!r} whose data has type {payload.get('type') if isinstance(payload, dict) else None!r}", data)
        if not named and name is not None:
            p.add(f"a named event {name!r} (chunks are unnamed)", data)
        payloads.append(payload)
    return p + STREAM_CHECKS[route](payloads, request)


class Recorder:
    """ASGI middleware that checks each 200 response of the generation routes as sent
    (`check_exchange`) without changing it: `violations` gathers what is wrong, `seen` the
    (route, content type) of each response checked. A response the client left before its end
    is skipped; the check never raises into the app."""

    def __init__(self, app) -> None:
        self.app = app
        self.violations: list[str] = []
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        request, body = bytearray(), bytearray()
        state = {"status": None, "type": "", "left": False}

        async def tee_receive():
            message = await receive()
            if message["type"] == "http.request":
                request.extend(message.get("body", b""))
            elif message["type"] == "http.disconnect":
                state["left"] = True
            return message

        async def tee_send(message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
                state["type"] = headers.get("content-type", "")
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            left = state["left"]  # the client gone before the end: what it got is cut short
            await send(message)
            if ended and not left:
                self._check(scope["path"], bytes(request), state["status"], state["type"], bytes(body))

        await self.app(scope, tee_receive, tee_send)

    def _check(self, route: str, request: bytes, status: int, content_type: str, body: bytes) -> None:
        if status != 200:
            return
        try:
            self.seen.append((route, content_type.split(";")[0]))
            self.violations += check_exchange(route, json.loads(request or b"{}"), status, content_type, body)
        except Exception as exc:  # noqa: BLE001 - a checker bug is reported, never raised into the app
            self.violations.append(f"POST {route}: the check itself failed: {exc!r}")

    def check(self) -> None:
        """AssertionError listing every violation recorded."""
        if self.violations:
            raise AssertionError(f"{len(self.violations)} conformance violations:\n" + "\n".join(self.violations))
