"""What the APIs share: admission, collecting choices, the one streaming loop, usage, errors.

A request with `n` choices becomes `n` engine sequences. Non-streaming requests watch for the
client's disconnect and abort their sequences; streaming ones abort when the SSE generator is
closed (sse-starlette closes it on disconnect).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from cache_manager.manager import CacheManager
from cache_manager.sessions import EntryPinnedError, is_anonymous
from grammars import (
    CompiledGrammar,
    answer_spec,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    auto_tool_spec,
    spec_from_request,
    tool_call_spec,
)
from server.engine import faults, lora
from server.engine.core import Engine, EngineStopped, QueueFull, RequestHandle, SessionBusy
from server.api import limits
from server.api.assembly import Assembly
from server.api.dialect import PLAIN, Dialect
from server.api.reasoning import ReasoningFormat
from server.api.vision_prompt import Vision
from server.api.errors import APIError
from server.metrics import Metrics
from server.engine.reasoning import ReasoningSpec
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest, RequestOutput, TokenInfo
from server.engine.vision import ImageSpan

RETRY_AFTER_S = "1"


@dataclass(slots=True)
class ServingContext:
    """Everything a route needs, built once by the app's lifespan."""

    engine: Engine
    cache_manager: CacheManager
    compiler: GrammarCompiler
    tokenizer: PreTrainedTokenizerBase
    metrics: Metrics
    model_id: str
    model_aliases: frozenset[str]
    max_context: int
    vocab_size: int
    max_tokens_default: int
    request_timeout_s: float
    fingerprint: str
    engine_paths: dict = field(default_factory=dict)  # how the engine runs: /v1/models' `engine` (startup.report_paths)
    dialect: Dialect = PLAIN  # how the model writes tool calls and reasoning (server/api/dialect.py)
    max_reasoning_tokens: int | None = None  # the server's default thinking budget
    max_request_tokens: int | None = None  # --max-request-tokens (None: limits.work_limit's default)
    adapters: lora.Adapters | None = None  # the loaded LoRA adapters, each served as a model of its own
    vision: Vision | None = None  # a vision-language model's processor and image limits (server/api/vision_prompt.py)
    ranks: list[dict] | None = None  # tensor parallel: each rank's device, weights and KV budget (startup.rank_budget)

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """The model's reasoning markers (None: it does not think)."""
        return self.dialect.reasoning

    @property
    def work_limit(self) -> int:
        """The most work one request may ask for (server/api/limits.py)."""
        return limits.work_limit(self.max_request_tokens, self.max_context)

    def adapter(self, model: str) -> lora.Adapter | None:
        """The LoRA adapter `model` names; None for the base model (or a model that does not
        exist: `check_model` answers those)."""
        return self.adapters.get(model) if self.adapters is not None else None

    def session_scopes(self, principal: str) -> list[tuple[str, str]]:
        """(model, the principal its sessions are keyed by) for the caller `principal`: the base
        model's, then each loaded LoRA adapter's (`lora.session_principal`). A session id may
        exist in several: one KV per model that computed it."""
        scopes = [(self.model_id, principal)]
        if self.adapters is not None:
            scopes += [(name, lora.session_principal(principal, a)) for name in self.adapters.names if (a := self.adapter(name)) is not None]
        return scopes

    def delete_session(self, principal: str, session_id: str) -> bool:
        """Delete the caller's session `session_id` under every model (`session_scopes`); False
        when it has none. EntryPinnedError while one is in flight (the others are deleted)."""
        deleted, busy = False, None
        for _, scoped in self.session_scopes(principal):
            try:
                deleted = self.cache_manager.delete_session(scoped, session_id) or deleted
            except EntryPinnedError as exc:
                busy = exc
        if busy is not None:
            raise busy
        return deleted

    def check_model(self, model: str) -> None:
        """404 `model_not_found` unless `model` is the served model, an alias or an adapter."""
        if model != self.model_id and model not in self.model_aliases and self.adapter(model) is None:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_id}'.",
                code="model_not_found",
                param="model",
                rejection="bad_request",
            )

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str, prompt_param: str | None = None) -> int:
        """max_tokens within the context, or 400 context_length_exceeded with the numbers. The
        error names `prompt_param` (`input`, `messages`) when the prompt alone leaves no room
        for one token, `param` (the max-tokens field) when that is what overflows."""
        room = self.max_context - prompt_len
        if requested is None:
            if room >= 1:
                return min(self.max_tokens_default, room)
            requested = 1
        if requested > room:
            raise limits.context_exceeded(
                self.max_context, f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion)", "the prompt or the completion length",
                prompt_param if room < 1 and prompt_param is not None else param,
            )
        return requested

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", code="invalid_value", param=param, rejection="bad_request")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


@dataclass(slots=True)
class Choice:
    """One choice's accumulated result (non-streaming); chat's and the Responses API's
    assembled as they come (server/api/assembly.py)."""

    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    final: RequestOutput | None = None
    assembly: Assembly | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def submit_all(ctx: ServingContext, requests: list[GenerationRequest], n: int) -> list[RequestHandle]:
    """Admit all of a request's sequences (prompts x `n` choices) or none: 429 when the queue is
    full now, 400 when the request could never fit."""
    check_capacity(ctx, len(requests), n)
    loop = asyncio.get_running_loop()
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(ctx.engine.submit(request, loop))
    except QueueFull as exc:
        for handle in handles:
            handle.cancel()
        raise APIError(429, f"server busy: {exc}; retry later", code="queue_full", headers={"Retry-After": RETRY_AFTER_S}, rejection="queue_full") from None
    except SessionBusy as exc:
        for handle in handles:
            handle.cancel()
        raise APIError(409, f"{exc}; retry when it is done", code="session_busy", param="prompt_cache_key", rejection="session_busy") from None
    except EngineStopped:
        for handle in handles:
            handle.cancel()
        raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": RETRY_AFTER_S}) from None
    return handles


def check_capacity(ctx: ServingContext, sequences: int, n: int) -> None:
    """A request larger than the server's queue, or with more choices than decode at once, can
    never run: 400 naming the limit (a 429 would have clients retry in vain)."""
    config = ctx.engine.config
    if sequences > config.max_queue:
        raise APIError(
            400,
            f"this request needs {sequences} sequences (prompts x n) but the server queues at most "
            f"{config.max_queue} (--max-queue); send fewer prompts or choices per request",
            code="too_many_sequences", param="n" if n > 1 else "prompt", rejection="too_large",
        )
    if n > config.max_running:
        raise APIError(
            400,
            f"n={n} choices decode together, but the server runs at most {config.max_running} "
            "sequences at once (--max-running)",
            code="too_many_sequences", param="n", rejection="too_large",
        )


def choice_params(ctx: ServingContext, body, max_tokens: int) -> list[SamplingParams]:
    """Sampling parameters of each of the n choices (seeded choices get seed, seed+1, ...)."""
    try:
        params = [body.to_sampling_params(max_tokens, seed_offset=j) for j in range(body.n)]
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="logit_bias", rejection="bad_request") from None
    ctx.check_token_ids(list(params[0].logit_bias), "logit_bias")
    return params


async def compile_grammar(ctx: ServingContext, body, tools: list | None = None, tool_choice=None) -> tuple[CompiledGrammar | None, str | None]:
    """The request's grammar, compiled (or from the LRU) off the event loop, before admission.

    Returns (grammar, tool_mode): tool_mode "forced" (tool_choice required or named), "auto"
    (tools offered: text or calls behind the trigger) or None. Calls are written in the
    model's own tool format (`ctx.dialect`) or kvserve's; `body.parallel_tool_calls`
    false (where the body has it) allows one call. An invalid, unsupported or too slow
    grammar is a 400 naming the field; nothing is queued.
    """
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    try:
        spec: GrammarSpec | None = spec_from_request(
            body.response_format, body.structured_outputs, body.guided_json, body.guided_regex,
            body.guided_choice, body.guided_grammar,
        )
        if tool_choice not in (None, "auto", "none") and not tools:
            raise GrammarError("tool_choice needs tools", "tool_choice")
        tool_spec = tool_call_spec(tools, tool_choice, parallel=parallel, fmt=ctx.dialect.calls) if tools else None
        if spec is not None and tool_spec is not None:
            raise GrammarError(f"a forced tool call and {spec.param} cannot be combined", "tool_choice")
        kind = spec.kind if spec is not None else None
        if spec is not None:  # a model whose answer is a message of its own gets its header
            spec = answer_spec(spec, ctx.dialect.tools)
        mode = "forced" if tool_spec is not None else None
        if spec is None and tool_spec is None and tools and tool_choice in (None, "auto"):
            tool_spec, mode = auto_tool_spec(tools, parallel=parallel, fmt=ctx.dialect.calls), "auto"
        spec = spec or tool_spec
        if spec is None:
            return None, None
        compiled = await asyncio.to_thread(ctx.compiler.compile, spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), code="invalid_grammar", param=exc.param, rejection="bad_schema") from None
    ctx.metrics.structured_requests.labels(f"tool_call_{mode}" if mode else kind).inc()
    return compiled, mode


def session_id(request: Request, prompt_cache_key: str | None) -> str | None:
    """OpenAI's `prompt_cache_key` body field, else the `X-Session-ID` header."""
    value = prompt_cache_key if prompt_cache_key is not None else request.headers.get("x-session-id")
    if value is None:
        return None
    param = "prompt_cache_key" if prompt_cache_key is not None else "X-Session-ID"
    if not value or len(value) > 256 or is_anonymous(value):
        raise APIError(400, f"{param} must be 1-256 characters and not start with 'anon-'", code="invalid_value", param=param, rejection="bad_request")
    return value


def generation_requests(
    request: Request, body, request_id: str, prompts: list[list[int]], params: list, timeout_s: float,
    grammar: CompiledGrammar | None = None, reasoning: ReasoningSpec | None = None, images: tuple[ImageSpan, ...] = (),
    watch=None,
) -> list[GenerationRequest]:
    """One engine request per (prompt, choice). Only the first uses the session: the others
    get private caches, so n > 1 neither serializes on the session nor races for its cache.
    `watch`: `GenerationRequest.watch`.

    A request for a LoRA adapter (`body.model`) runs with it, under the adapter's own principal
    (`lora.session_principal`): its sessions and anonymous prefixes, in every tier and across
    restarts, never meet the base model's or another adapter's KV."""
    adapter = request.app.state.kv.ctx.adapter(body.model)
    principal = lora.session_principal(request.state.principal, adapter)
    session = session_id(request, body.prompt_cache_key)
    out = []
    for p, prompt_ids in enumerate(prompts):
        for j, sampling in enumerate(params):
            index = p * len(params) + j
            out.append(GenerationRequest(
                f"{request_id}-{index}", prompt_ids, sampling, timeout_s=timeout_s,
                principal=principal, session_id=session, use_session=index == 0, grammar=grammar,
                speculative=body.speculative, reasoning=reasoning, fault=faults.request_fault(request.headers),
                adapter=adapter, images=images, watch=watch,
            ))
    return out


async def admission_headers(ctx: ServingContext, request: Request, handles: list[RequestHandle]) -> dict[str, str]:
    """Wait until the engine took the first choice; its cache decision as response headers.

    Raises the engine's error if the request failed before admission. Watches for the client
    leaving meanwhile.
    """
    watcher = asyncio.create_task(_watch_disconnect(request, handles))
    try:
        first = await handles[0].admitted()
    finally:
        watcher.cancel()
    if first.error is not None:
        for handle in handles:
            handle.cancel()
        raise engine_error(first, ctx.request_timeout_s)
    return cache_headers(first)


def cache_headers(output: RequestOutput) -> dict[str, str]:
    """X-Cache-Reused-Tokens always; X-Cache-Miss-Reason when nothing was reused."""
    headers = {"X-Cache-Reused-Tokens": str(output.cached_tokens)}
    if output.miss_reason is not None:
        headers["X-Cache-Miss-Reason"] = output.miss_reason
    return headers


def timed_out(timeout_s: float) -> APIError:
    """The 504 of a request still running at its deadline (--request-timeout-s)."""
    return APIError(504, f"the request ran longer than its {timeout_s:g} s deadline", code="timeout")


def engine_error(output: RequestOutput, timeout_s: float) -> APIError:
    if output.error == "kv_budget":
        return APIError(
            400,
            "this request's KV cache (prompt + max_tokens) does not fit the server's KV budget; "
            "reduce max_tokens or the prompt",
            code="kv_budget_exceeded",
            rejection="kv_budget",
        )
    if output.error == "adapter_unloaded":
        return APIError(404, "the LoRA adapter this request asked for was unloaded before it finished", code="model_not_found", param="model")
    if output.error == "timeout":
        return timed_out(timeout_s)
    if output.error == "grammar":
        return APIError(
            400,
            "the output constraint reached a dead end: no output that satisfies it can be completed "
            "from here (no partial output is returned); simplify the schema or grammar",
            code="grammar_dead_end",
        )
    if output.finish_reason == "abort":
        return APIError(503, "the request was aborted before it finished (the server is shutting down)", code="aborted", headers={"Retry-After": RETRY_AFTER_S})
    if output.error == "out_of_memory":
        return APIError(
            503, "out of device memory: this request could not run even alone in a step (one token at a time); "
            "retry later, or ask the operator to lower --max-batch-tokens or --gpu-memory-utilization",
            code="out_of_memory", headers={"Retry-After": RETRY_AFTER_S},
        )
    if output.error == "engine_dead":
        return APIError(503, "the model stopped running; the server is exiting to be restarted (see its log)", code="engine_dead", headers={"Retry-After": RETRY_AFTER_S})
    return APIError(500, "internal error while generating", code="internal_error")


class Tracker:
    """Latency metrics of one choice as its outputs arrive."""

    def __init__(self, metrics: Metrics, arrived: float, handle: RequestHandle) -> None:
        self.metrics, self.arrived, self.handle = metrics, arrived, handle
        self.last: float | None = None

    def saw(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if output.tokens:
            if self.last is None:
                admission = self.handle.admission
                cache = "hit" if admission is not None and admission.cached_tokens else "miss"
                self.metrics.ttft.labels(cache).observe(now - self.arrived)
                if self.handle.first_scheduled_at is not None:
                    self.metrics.queue_time.observe(self.handle.first_scheduled_at - self.arrived)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        if output.finished:
            self.metrics.e2e.observe(now - self.arrived)
            self.metrics.prompt_tokens.inc(output.prompt_tokens)
            self.metrics.generation_tokens.inc(output.completion_tokens)
            self.metrics.cached_prompt_tokens.inc(output.cached_tokens)
            self.metrics.prompt_length.observe(output.prompt_tokens)
            self.metrics.generation_length.observe(output.completion_tokens)
            if (adapter := self.handle.adapter) is not None:
                self.metrics.lora_request(adapter.name, output.prompt_tokens, output.completion_tokens)


async def _merge(handles: list[RequestHandle], ctx: ServingContext, arrived: float) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all choices as they come, tagged with the choice index."""
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        tracker = Tracker(ctx.metrics, arrived, handle)
        async for output in handle:
            tracker.saw(output)
            await queue.put((index, output))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                index, output = await queue.get()
                yield index, output
                if output.finished:
                    break
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


async def _watch_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel()


async def collect(ctx: ServingContext, request: Request, handles: list[RequestHandle], route: str, assembly=None) -> list[Choice]:
    """Run all choices to the end; raise the engine's error as an APIError. With `assembly`
    (makes an `Assembly`), each choice is assembled as it comes."""
    arrived = time.monotonic()
    choices = [Choice(i, assembly=assembly() if assembly is not None else None) for i in range(len(handles))]
    watcher = asyncio.create_task(_watch_disconnect(request, handles))
    try:
        async for index, output in _merge(handles, ctx, arrived):
            choice = choices[index]
            choice.text += output.text
            choice.tokens += output.tokens
            if choice.assembly is not None:
                choice.assembly.feed(output)
                if output.finished:
                    choice.assembly.finish(output.finish_reason)
            if output.finished:
                choice.final = output
                ctx.metrics.finished.labels(route, output.finish_reason).inc()
    finally:
        watcher.cancel()
    for choice in choices:
        if choice.final.error is not None or choice.final.finish_reason == "abort":
            raise engine_error(choice.final, ctx.request_timeout_s)
    return choices


class Rendering(Protocol):
    """How one API renders a streamed request: the SSE events `stream` sends (each what
    sse-starlette takes: a `data:` string, or a dict with its `event` and `data`)."""

    def opening(self) -> list:
        """The events before any output."""

    def output(self, index: int, output: RequestOutput) -> list:
        """The events of choice `index`'s next output (its final one included)."""

    def failed(self, output: RequestOutput, error: APIError) -> list:
        """The closing events when a choice failed or was aborted (`output` its final one)."""

    def closing(self, finals: list[RequestOutput]) -> list:
        """The closing events once every choice finished (`finals`: their final outputs)."""


async def stream(ctx: ServingContext, handles: list[RequestHandle], route: str, rendering: Rendering,
                 arrived: float | None = None) -> AsyncIterator:
    """The one streaming loop of every API: the engine's outputs of every choice as they come,
    rendered by `rendering`. A choice that fails or is aborted ends the stream (`rendering.failed`).
    Choices cut off by the client leaving count as aborted in the finished and end-to-end
    metrics. `arrived`: when the request arrived (default: now), for the latency metrics.
    """
    arrived = time.monotonic() if arrived is None else arrived
    finals: list[RequestOutput] = []
    ended = 0  # choices whose final output arrived, whatever its reason
    try:
        for event in rendering.opening():
            yield event
        async for index, output in _merge(handles, ctx, arrived):
            if output.finished:
                ended += 1
                ctx.metrics.finished.labels(route, output.finish_reason).inc()
                if output.error is not None or output.finish_reason == "abort":
                    for event in rendering.failed(output, engine_error(output, ctx.request_timeout_s)):
                        yield event
                    return
                finals.append(output)
            for event in rendering.output(index, output):
                yield event
        for event in rendering.closing(finals):
            yield event
    finally:
        for _ in range(len(handles) - ended):  # cut off by the client, or by another choice's error
            ctx.metrics.finished.labels(route, "abort").inc()
            ctx.metrics.e2e.observe(time.monotonic() - arrived)


@dataclass
class Chunks:
    """The rendering of chat and completions: `chunk` objects from `on_output`, closing ones
    from `on_end`, then `[DONE]`; a failed choice sends the error object (OpenAI has no
    "abort" finish reason)."""

    on_output: Callable[[int, RequestOutput], list[dict]]
    on_end: Callable[[list[RequestOutput]], list[dict]]

    def opening(self) -> list:
        return []

    def output(self, index: int, output: RequestOutput) -> list:
        return [json.dumps(chunk, ensure_ascii=False) for chunk in self.on_output(index, output)]

    def failed(self, output: RequestOutput, error: APIError) -> list:
        return [json.dumps(error.body())]

    def closing(self, finals: list[RequestOutput]) -> list:
        return [json.dumps(chunk, ensure_ascii=False) for chunk in self.on_end(finals)] + ["[DONE]"]


def usage(finals: list[RequestOutput], n: int, *, thinking: bool = False) -> dict:
    """Usage of a request: each prompt counted once (not once per choice), completions summed;
    for a thinking model (`thinking`) the completion tokens spent before the answers."""
    prompt = sum(o.prompt_tokens for o in finals) // n
    completion = sum(o.completion_tokens for o in finals)
    cached = min(prompt, sum(o.cached_tokens for o in finals))  # only the first choice reuses
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if thinking:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(o.reasoning_tokens for o in finals)}
    return out


