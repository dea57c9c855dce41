"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat objects."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from sse_starlette import EventSourceResponse

from grammars import output_format, tool_format
from server.api import serving
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest
from server.engine.sequence import RequestOutput, TokenInfo
from server.api.serving import ServingContext
from server.api.tool_calls import tool_parser

ROUTE = "/v1/chat/completions"


TOOLS_PROMPT = (
    "You can call these functions:\n{tools}\n"
    "To call one, reply with only {example}; to call several, write one such call per line. "
    "Otherwise reply normally."
)


def template_messages(tokenizer, body: ChatCompletionRequest) -> list[dict]:
    """Messages for the chat template, earlier calls' arguments as objects (what templates
    that know tools expect). A template that knows nothing of tools (no `tools` in its
    source) gets them as a system note showing how a call is written, and earlier calls
    written back in that form (several calls of one turn as the grammar writes them), so the
    model sees what the grammar allows."""
    messages = [m.for_template() for m in body.messages]
    for message in messages:
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    if not body.tools or body.tool_choice == "none" or "tools" in (tokenizer.chat_template or ""):
        return messages
    fmt = output_format(tool_format(tokenizer))
    marker_text = {i: tokenizer.convert_ids_to_tokens(i) for i in fmt.marker_ids}
    for message in messages:
        calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments", {}))
                 for c in message.pop("tool_calls", None) or []]
        if calls:
            message["content"] += fmt.render(calls, marker_text)
    example = fmt.render([("<function name>", "<arguments object>")], marker_text).replace('"<', "<").replace('>"', ">")
    note = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t)) for t in body.tools), example=example)
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
    """One token's logprobs; `bytes` are the token's own bytes (a byte-fallback or partial
    UTF-8 token gives its raw byte, not U+FFFD's encoding as its `token` text does)."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": ctx.token_text(token_id), "logprob": logprob, "bytes": list(ctx.compiler.ll_tokenizer.decode_bytes([token_id]))}

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
            for message, finish_reason in [assistant_message(c.text, c.final.finish_reason, tool_mode, tokenizer=ctx.tokenizer, tokens=c.tokens)]
        ],
        "usage": serving.usage([c.final for c in choices], body.n),
    })


def assistant_message(
    text: str, finish_reason: str, tool_mode: str | None, *, tokenizer=None, tokens: list[TokenInfo] | None = None,
) -> tuple[dict, str]:
    """A finished choice's message fields and finish reason; generated calls become
    `tool_calls` (arguments as the JSON text generated), with finish reason "tool_calls", or
    "length" for a call max_tokens cut short (its arguments so far). Text around the calls is
    `content`; the format's wrappers never are.

    Pass the `tokenizer` and the choice's `tokens` so that a model's marker tokens (absent
    from the text) are seen; without them the text is read in kvserve's own format.
    """
    parser = tool_parser(tokenizer, tool_mode)
    if parser is None:
        return {"content": text, "refusal": None}, finish_reason
    parser.feed(RequestOutput(text=text, tokens=tokens or [], finish_reason=finish_reason))
    _, finish_reason = parser.finish(finish_reason)
    message = {"content": parser.content or (None if parser.calls else ""), "refusal": None}
    if parser.calls:
        message["tool_calls"] = [call.wire() for call in parser.calls]
    return message, finish_reason


def _chunkers(ctx: ServingContext, body: ChatCompletionRequest, head: dict, tool_mode: str | None = None):
    """The two callbacks that turn engine outputs into chat.completion.chunk objects.

    Under a tool mode each choice's output goes through a `ToolCallParser`: content streams as
    text; each call streams as OpenAI's do, a first delta with its index, id and name, then
    its arguments as they are generated. The format's wrappers are never sent.
    """
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    started: set[int] = set()
    parsers: dict[int, object] = {}
    pending_logprobs: dict[int, list] = {}  # logprobs of tokens whose text is not sent yet

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        out = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if include_usage:
            out["usage"] = None
        return out

    def deltas(events) -> list[dict]:
        out = [{"content": events.content}] if events.content else []
        for call in events.started:
            fn = {"name": call.name, "arguments": events.arguments.pop(call.index, "")}
            out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": fn}]})
        for i, text in events.arguments.items():
            out.append({"tool_calls": [{"index": i, "function": {"arguments": text}}]})
        return out

    def on_output(index: int, output: RequestOutput) -> list[dict]:
        chunks = []
        if index not in started:
            started.add(index)
            parsers[index] = tool_parser(ctx.tokenizer, tool_mode)
            chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        parser = parsers[index]
        finish_reason = output.finish_reason
        if parser is None:
            out = [{"content": output.text}] if output.text else []
        else:
            out = deltas(parser.feed(output))
            if output.finished:
                events, finish_reason = parser.finish(output.finish_reason)
                out += deltas(events)
        logprobs = pending_logprobs.pop(index, [])
        if body.logprobs:
            logprobs += [logprobs_entry(ctx, t) for t in output.tokens]
        if logprobs and not out and not output.finished:
            pending_logprobs[index] = logprobs
        for i, delta in enumerate(out):
            chunks.append(chunk(index, delta, logprobs={"content": logprobs} if i == 0 and logprobs else None))
        if output.finished:
            chunks.append(chunk(index, {}, finish_reason=finish_reason,
                                logprobs={"content": logprobs} if logprobs and not out else None))
        return chunks

    def on_end(finals: list[RequestOutput]) -> list[dict]:
        if not include_usage:
            return []
        return [{**head, "object": "chat.completion.chunk", "choices": [], "usage": serving.usage(finals, body.n)}]

    return on_output, on_end
