"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat objects."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from sse_starlette import EventSourceResponse

from grammars import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from server import serving
from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.sequence import RequestOutput, TokenInfo
from server.serving import ServingContext

ROUTE = "/v1/chat/completions"


TOOLS_PROMPT = (
    "You can call these functions:\n{tools}\n"
    "To call one, reply with only " + TOOL_CALL_OPEN + '{{"name": <function name>, "arguments": '
    "<arguments object>}}" + TOOL_CALL_CLOSE + ". Otherwise reply normally."
)


def template_messages(tokenizer, body: ChatCompletionRequest) -> list[dict]:
    """Messages for the chat template. A template that knows nothing of tools (no `tools` in
    its source) gets them as a system note with the `<tool_call>` trigger, and earlier calls
    written back in that form, so the model sees what the grammar allows."""
    messages = [m.for_template() for m in body.messages]
    if not body.tools or body.tool_choice == "none" or "tools" in (tokenizer.chat_template or ""):
        return messages
    for message in messages:
        for call in message.pop("tool_calls", None) or []:
            fn = call.get("function", {})
            arguments = fn.get("arguments", "{}")
            payload = json.dumps({"name": fn.get("name"), "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments})
            message["content"] += TOOL_CALL_OPEN + payload + TOOL_CALL_CLOSE
    note = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t)) for t in body.tools))
    if messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + note
    else:
        messages.insert(0, {"role": "system", "content": note})
    return messages


def render_prompt(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """Chat template -> token ids (runs off the event loop: templates and tokenizers are slow)."""
    try:
        messages = template_messages(tokenizer, body)
        text = tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", code="invalid_value", param="messages", rejection="bad_request") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def logprobs_entry(ctx: ServingContext, token: TokenInfo) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    entry = item(token.token_id, token.logprob)
    entry["top_logprobs"] = [item(t, lp) for t, lp in token.top]
    return entry


async def create(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    ctx.check_model(body.model)
    prompt_ids = await asyncio.to_thread(render_prompt, ctx.tokenizer, body)
    max_tokens = ctx.resolve_max_tokens(len(prompt_ids), body.requested_max_tokens(), "max_tokens")
    params = serving.choice_params(ctx, body, max_tokens)
    grammar, tool_mode = await serving.compile_grammar(ctx, body, body.tools, body.tool_choice)
    request_id = serving.new_id("chatcmpl")
    requests = serving.generation_requests(request, body, request_id, [prompt_ids], params, ctx.request_timeout_s, grammar)
    handles = serving.submit_all(ctx, requests, len(params))
    created = int(time.time())
    head = {
        "id": request_id,
        "created": created,
        "model": body.model,
        "system_fingerprint": ctx.fingerprint,
    }
    if body.stream:
        headers = await serving.admission_headers(ctx, request, handles)
        return EventSourceResponse(
            serving.stream(ctx, handles, ROUTE, *_chunkers(ctx, body, head, tool_mode)),
            ping=15,
            headers=headers,
        )
    choices = await serving.collect(ctx, request, handles, ROUTE)
    return JSONResponse(headers=serving.cache_headers(choices[0].final), content={
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", **message},
                "logprobs": {"content": [logprobs_entry(ctx, t) for t in c.tokens]} if body.logprobs else None,
                "finish_reason": finish_reason,
            }
            for c in choices
            for message, finish_reason in [assistant_message(c.text, c.final.finish_reason, tool_mode)]
        ],
        "usage": serving.usage([c.final for c in choices], body.n),
    })


def assistant_message(text: str, finish_reason: str, tool_mode: str | None) -> tuple[dict, str]:
    """The message fields and finish reason; a completed tool call becomes `tool_calls`.

    Forced calls are the whole output, `{"name": ..., "arguments": {...}}`; under "auto" a call
    is wrapped in `<tool_call>...</tool_call>`. OpenAI's wire format carries the arguments as a
    JSON string. A call cut short by max_tokens stays text.
    """
    if tool_mode == "auto" and text.startswith(TOOL_CALL_OPEN):
        text_call = text.removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE)
    elif tool_mode == "forced":
        text_call = text
    else:
        return {"content": text, "refusal": None}, finish_reason
    if finish_reason != "stop":
        return {"content": text, "refusal": None}, finish_reason
    call = json.loads(text_call)
    return {
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
        ],
    }, "tool_calls"


def _chunkers(ctx: ServingContext, body: ChatCompletionRequest, head: dict, tool_mode: str | None = None):
    """The two callbacks that turn engine outputs into chat.completion.chunk objects.

    A tool call is sent whole in one `tool_calls` delta once it is complete (its text is
    buffered, so a client never sees half a call as content). Under "auto" the first character
    decides: `<` starts a call, anything else streams as text.
    """
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    started: set[int] = set()
    buffered: dict[int, str] = {}  # tool-call text held back until complete
    streaming: set[int] = set()  # choices already streaming as text

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        out = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if include_usage:
            out["usage"] = None
        return out

    def holds_back(index: int, output: RequestOutput) -> bool:
        if index in buffered or tool_mode == "forced":
            return True
        return tool_mode == "auto" and index not in streaming and output.text.startswith("<")

    def on_output(index: int, output: RequestOutput) -> list[dict]:
        chunks = []
        if index not in started:
            started.add(index)
            chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        logprobs = None
        if body.logprobs and output.tokens:
            logprobs = {"content": [logprobs_entry(ctx, t) for t in output.tokens]}
        if holds_back(index, output):
            buffered[index] = buffered.get(index, "") + output.text
            if not output.finished:
                return chunks
            message, finish_reason = assistant_message(buffered.pop(index), output.finish_reason, tool_mode)
            if "tool_calls" in message:
                delta = {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
            else:
                delta = {"content": message["content"]}
            chunks.append(chunk(index, delta))
            chunks.append(chunk(index, {}, finish_reason=finish_reason))
            return chunks
        if output.text or logprobs:
            streaming.add(index)
            chunks.append(chunk(index, {"content": output.text}, logprobs=logprobs))
        if output.finished:
            chunks.append(chunk(index, {}, finish_reason=output.finish_reason))
        return chunks

    def on_end(finals: list[RequestOutput]) -> list[dict]:
        if not include_usage:
            return []
        return [{**head, "object": "chat.completion.chunk", "choices": [], "usage": serving.usage(finals, body.n)}]

    return on_output, on_end
