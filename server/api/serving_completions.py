"""POST /v1/completions: prompt text or token ids -> engine -> OpenAI text_completion objects.

Choice indices follow OpenAI: prompt p's j-th choice has index p * n + j.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from server.api import limits, serving
from server.api.errors import APIError
from server.api.protocol import CompletionRequest
from server.engine.sequence import RequestOutput, TokenInfo
from server.api.serving import ServingContext

ROUTE = "/v1/completions"


def tokenize_prompts(tokenizer, prompts: list[str | list[int]], max_context: int) -> list[list[int]]:
    """Each prompt's token ids; a text far longer than the context is refused early, naming
    `prompt` (`limits.prompt_ids`), before the prompts after it are tokenized."""
    return [p if isinstance(p, list) else limits.prompt_ids(tokenizer, p, max_context, "prompt") for p in prompts]


def logprobs_block(ctx: ServingContext, tokens: list[TokenInfo], offset: int) -> dict:
    """The legacy logprobs object: parallel lists of tokens, logprobs, top maps, text offsets."""
    texts = [ctx.token_text(t.token_id) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{ctx.token_text(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


async def create(ctx: ServingContext, body: CompletionRequest, request: Request):
    ctx.check_model(body.model)
    prompts = await asyncio.to_thread(tokenize_prompts, ctx.tokenizer, body.prompts(), ctx.max_context)
    for prompt_ids in prompts:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", code="invalid_value", param="prompt", rejection="bad_request")
        ctx.check_token_ids(prompt_ids, "prompt")
        ctx.resolve_max_tokens(len(prompt_ids), body.max_tokens, "max_tokens", "prompt")
    limits.Work(len(prompts), body.n, body.logprobs or 0, logprobs_param="logprobs").check(ctx.work_limit, body.max_tokens)
    params = serving.choice_params(ctx, body, body.max_tokens)
    grammar, _ = await serving.compile_grammar(ctx, body)
    request_id = serving.new_id("cmpl")
    requests = serving.generation_requests(request, body, request_id, prompts, params, ctx.request_timeout_s, grammar)
    handles = serving.submit_all(ctx, requests, len(params))
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": ctx.fingerprint,
    }
    if body.stream:
        headers = await serving.admission_headers(ctx, request, handles)
        return EventSourceResponse(serving.stream(ctx, handles, ROUTE, serving.Chunks(*_chunkers(ctx, body, head))), ping=15, headers=headers)
    choices = await serving.collect(ctx, request, handles, ROUTE)
    return JSONResponse(headers=serving.cache_headers(choices[0].final), content={
        **head,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": logprobs_block(ctx, c.tokens, 0) if body.logprobs is not None else None,
                "finish_reason": c.final.finish_reason,
            }
            for c in choices
        ],
        "usage": serving.usage([c.final for c in choices], body.n),
    })


def _chunkers(ctx: ServingContext, body: CompletionRequest, head: dict):
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    offsets: dict[int, int] = {}

    def on_output(index: int, output: RequestOutput) -> list[dict]:
        logprobs = None
        if body.logprobs is not None and output.tokens:
            logprobs = logprobs_block(ctx, output.tokens, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(output.text)
        if not (output.text or logprobs or output.finished):
            return []
        chunk = {
            **head,
            "choices": [{"index": index, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}],
        }
        if include_usage:
            chunk["usage"] = None
        return [chunk]

    def on_end(finals: list[RequestOutput]) -> list[dict]:
        if not include_usage:
            return []
        return [{**head, "choices": [], "usage": serving.usage(finals, body.n)}]

    return on_output, on_end
