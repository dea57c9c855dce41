"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat objects."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from grammars import ToolFormat
from server.api import limits, reasoning, serving, vision_prompt
from server.api.assembly import Assembly
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest
from server.engine.sequence import RequestOutput, TokenInfo
from server.engine.vision import ImageSpan
from server.api.serving import ServingContext

ROUTE = "/v1/chat/completions"


TOOLS_PROMPT = (
    "You can call these functions:\n{tools}\n"
    "To call one, reply with only {example}; to call several, write one such call per line. "
    "Otherwise reply normally."
)


# Tools and earlier calls' arguments nest at most this deep in what a chat template gets:
# templates walk them recursively (transformers' `_plain_template_data`, jinja's `tojson`) and
# overflow Python's stack a few hundred levels down; the tool grammar's JSON parser stops at 128.
MAX_TEMPLATE_DEPTH = 128


def converted(convert, param: str):
    """`convert()`: a chat request converted from another API's conversation (Responses' input,
    a Messages turn); the refusals of chat's own validation as a 400 on `param`."""
    try:
        return convert()
    except ValidationError as exc:
        message = str(exc.errors()[0].get("msg", "invalid")).removeprefix("Value error, ")
        raise APIError(400, f"the conversation cannot be rendered as a chat: {message}", code="invalid_value", param=param,
                       rejection="bad_request") from None


def nesting_depth(value) -> int:
    """How deeply `value` nests dicts and lists (0 for a scalar). Iterative: the depth is the
    client's to choose."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return depth


def template_arguments(arguments: str | dict):
    """An earlier call's arguments as a chat template takes them: the parsed object when the
    text is JSON, else the text as the model wrote it (a call max_tokens cut short); text
    too for an object nested deeper than MAX_TEMPLATE_DEPTH."""
    if isinstance(arguments, dict):
        text, parsed = None, arguments
    else:
        try:
            text, parsed = arguments, json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    if nesting_depth(parsed) <= MAX_TEMPLATE_DEPTH:
        return parsed
    return text if text is not None else json.dumps(parsed, ensure_ascii=False)


def template_messages(tokenizer, fmt: ToolFormat, body: ChatCompletionRequest) -> list[dict]:
    """Messages for the chat template, earlier calls' arguments as objects (what templates
    that know tools expect) where they parse, as written where they do not
    (`template_arguments`). A template that knows nothing of tools (no `tools` in its
    source) gets them as a system note showing how a call is written, and earlier calls
    written back in that form (several calls of one turn as the grammar writes them, in
    `fmt`: `Dialect.calls`), so the model sees what the grammar allows."""
    for tool in body.tools or ():
        if nesting_depth(tool) > MAX_TEMPLATE_DEPTH:
            name = (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) else None
            raise APIError(
                400, f"tool {name!r} nests deeper than {MAX_TEMPLATE_DEPTH} levels, more than a chat template renders",
                code="invalid_value", param="tools", rejection="bad_request",
            )
    messages = [m.for_template() for m in body.messages]
    for message in messages:
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            if "arguments" in fn:
                fn["arguments"] = template_arguments(fn["arguments"])
    if not body.tools or body.tool_choice == "none" or "tools" in (tokenizer.chat_template or ""):
        return messages
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


def chat_text(tokenizer, fmt: ToolFormat, body: ChatCompletionRequest, template_kwargs: dict | None = None, *,
              generation_prompt: bool = True, continue_final: bool = False) -> str:
    """The chat template's text of the conversation (blocking: templates are slow), ending
    with the generation prompt (or without it; or, `continue_final`, inside the last message,
    left open). `template_kwargs`: the thinking switches (`reasoning.controls`)."""
    try:
        messages = template_messages(tokenizer, fmt, body)
        return tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=generation_prompt and not continue_final, continue_final_message=continue_final,
            tokenize=False, **(template_kwargs or {})
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", code="invalid_value", param="messages", rejection="bad_request") from None


def render_prompt(tokenizer, fmt: ToolFormat, body: ChatCompletionRequest, template_kwargs: dict | None = None, *,
                  max_context: int | None = None, prompt_param: str = "messages", **ending) -> list[int]:
    """Chat template -> token ids (runs off the event loop: templates and tokenizers are slow).
    With `max_context`, a conversation far longer than the context is refused early, naming
    `prompt_param` (`limits.prompt_ids`). `ending`: `chat_text`'s."""
    text = chat_text(tokenizer, fmt, body, template_kwargs, **ending)
    if max_context is None:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return limits.prompt_ids(tokenizer, text, max_context, prompt_param, add_special_tokens=False)


def logprobs_entry(ctx: ServingContext, token: TokenInfo) -> dict:
    """One token's logprobs; `bytes` are the token's own bytes (a byte-fallback or partial
    UTF-8 token gives its raw byte, not U+FFFD's encoding as its `token` text does)."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": ctx.token_text(token_id), "logprob": logprob, "bytes": list(ctx.compiler.ll_tokenizer.decode_bytes([token_id]))}

    entry = item(token.token_id, token.logprob)
    entry["top_logprobs"] = [item(t, lp) for t, lp in token.top]
    return entry


@dataclass(slots=True)
class Submitted:
    """A chat turn the engine took: its sequences' handles, and `assembly()`, a new `Assembly`
    for one of its choices."""

    handles: list
    prompt_tokens: int
    assembly: Callable[[], Assembly]


async def prompt(ctx: ServingContext, body: ChatCompletionRequest, template_kwargs: dict, prompt_param: str = "messages", *,
                 bounded: bool = True, **ending) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A conversation's prompt ids as the engine takes them, and its pictures' spans (their
    positions keyed by content: server/api/vision_prompt.py); images sent to a model that
    takes none are a 400. `bounded`: a conversation far longer than the context is refused
    early (`render_prompt`). `ending`: how the text ends (`chat_text`)."""
    images = body.images()
    if images and ctx.vision is None:
        vision_prompt.refuse_images(ctx.model_id, images)
    render = functools.partial(chat_text, ctx.tokenizer, ctx.dialect.calls, body, template_kwargs, **ending)
    if images:
        return await vision_prompt.render(ctx.vision, render, images, prompt_param)
    ids = await asyncio.to_thread(render_prompt, ctx.tokenizer, ctx.dialect.calls, body, template_kwargs, prompt_param=prompt_param,
                                  max_context=ctx.max_context if bounded else None, **ending)
    return ids, ()


async def submit(ctx: ServingContext, body: ChatCompletionRequest, request: Request, request_id: str, *,
                 requested_max_tokens: int | None, max_tokens_param: str = "max_tokens", prompt_param: str = "messages",
                 continue_final: bool = False) -> Submitted:
    """Everything between a chat request and the engine, for every API (the Responses and
    Messages APIs convert their turn to a chat request first): the thinking controls, the chat
    template, the token limit, sampling, the grammar, the reasoning spec; then its sequences
    are queued. `continue_final`: the answer continues the last (assistant) message."""
    template_kwargs, budget = reasoning.controls(ctx, body.reasoning_effort, body.chat_template_kwargs, body.max_reasoning_tokens)
    prompt_ids, spans = await prompt(ctx, body, template_kwargs, prompt_param, continue_final=continue_final)
    if spans:
        ctx.metrics.images.inc(len(spans))
        ctx.metrics.image_tokens.inc(sum(span.length for span in spans))
    max_tokens = ctx.resolve_max_tokens(len(prompt_ids), requested_max_tokens, max_tokens_param, prompt_param)
    work = limits.Work(1, body.n, (body.top_logprobs or 0) if body.logprobs else 0, max_tokens_param)
    if requested_max_tokens is None:
        max_tokens = work.default_max_tokens(ctx.work_limit, max_tokens)
    work.check(ctx.work_limit, max_tokens)
    params = serving.choice_params(ctx, body, max_tokens)
    grammar, tool_mode = await serving.compile_grammar(ctx, body, body.tools, body.tool_choice)
    thinking = reasoning.spec(ctx, prompt_ids, budget, tool_mode)
    assembly = functools.partial(Assembly, ctx.dialect, ctx.tokenizer, tool_mode, thinking=thinking is not None, tools=body.tools)
    # NOTE: the engine runs its own assembly of each choice beside the one rendered here, so a
    # repeated call stops the sequence at its last token, not at whatever step the client's
    # events are made (`GenerationRequest.watch`)
    requests = serving.generation_requests(request, body, request_id, [prompt_ids], params, ctx.request_timeout_s, grammar, thinking,
                                           images=spans, watch=assembly if tool_mode is not None else None)
    return Submitted(serving.submit_all(ctx, requests, len(params)), len(prompt_ids), assembly)


async def create(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    ctx.check_model(body.model)
    request_id = serving.new_id("chatcmpl")
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    turn = await submit(ctx, body, request, request_id, requested_max_tokens=body.requested_max_tokens(),
                        max_tokens_param=max_tokens_param)
    handles = turn.handles
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
            serving.stream(ctx, handles, ROUTE, serving.Chunks(*_chunkers(ctx, body, head, turn.assembly))),
            ping=15,
            headers=headers,
        )
    choices = await serving.collect(ctx, request, handles, ROUTE, turn.assembly)
    return JSONResponse(headers=serving.cache_headers(choices[0].final), content={
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", **c.assembly.message()},
                "logprobs": {"content": [logprobs_entry(ctx, t) for t in c.tokens]} if body.logprobs else None,
                "finish_reason": c.assembly.finish_reason,
            }
            for c in choices
        ],
        "usage": serving.usage([c.final for c in choices], body.n, thinking=ctx.reasoning is not None),
    })


def _chunkers(ctx: ServingContext, body: ChatCompletionRequest, head: dict, assembly):
    """The two callbacks that turn engine outputs into chat.completion.chunk objects.

    Each choice's outputs go through its `Assembly` (`assembly()` makes one): reasoning
    streams as `reasoning_content` and `reasoning` deltas, the answer as `content`; each call
    streams as OpenAI's do, a first delta with its index, id and name, then its arguments as
    they are generated. The format's wrappers and the reasoning markers are never sent.
    """
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    assemblies: dict[int, Assembly] = {}
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

    def deltas(parts) -> list[dict]:
        out = [{"reasoning_content": parts.reasoning, "reasoning": parts.reasoning}] if parts.reasoning else []
        if parts.content:
            out.append({"content": parts.content})
        for call in parts.started:
            fn = {"name": call.name, "arguments": parts.arguments.pop(call.index, "")}
            out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": fn}]})
        for i, text in parts.arguments.items():
            out.append({"tool_calls": [{"index": i, "function": {"arguments": text}}]})
        return out

    def on_output(index: int, output: RequestOutput) -> list[dict]:
        chunks = []
        if index not in assemblies:
            assemblies[index] = assembly()
            chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        choice = assemblies[index]
        out = deltas(choice.feed(output))
        if output.finished:
            out += deltas(choice.finish(output.finish_reason))
        logprobs = pending_logprobs.pop(index, [])
        if body.logprobs:
            logprobs += [logprobs_entry(ctx, t) for t in output.tokens]
        if logprobs and not out and not output.finished:
            pending_logprobs[index] = logprobs
        for i, delta in enumerate(out):
            chunks.append(chunk(index, delta, logprobs={"content": logprobs} if i == 0 and logprobs else None))
        if output.finished:
            chunks.append(chunk(index, {}, finish_reason=choice.finish_reason,
                                logprobs={"content": logprobs} if logprobs and not out else None))
        return chunks

    def on_end(finals: list[RequestOutput]) -> list[dict]:
        if not include_usage:
            return []
        return [{**head, "object": "chat.completion.chunk", "choices": [], "usage": serving.usage(finals, body.n, thinking=ctx.reasoning is not None)}]

    return on_output, on_end
