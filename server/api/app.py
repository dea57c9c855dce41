"""create_app(settings, lifecycle) -> FastAPI: the routes, middleware and lifecycle of the HTTP
server over the serving context that the composition root builds (server/startup.py, which
passes its own functions as the `Lifecycle` and is where callers get the app from).

The lifespan starts loading the model in the background, so the process answers /health at once
and /ready turns 200 only after the model is loaded, its start-up forward pass (prefill and
decode, on the engine's own paths) has run and warm-up requests have been generated. Routes
that need the model answer 503 `model_loading` until then. A start-up error no request can fix
sets `AppState.exit_status` (server/exits.py), and `kvserve serve` exits with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import start_http_server

from server import __version__ as VERSION
from server import exits
from server.api.errors import APIError, install_handlers
from server.api.middleware import Auth, BodyLimit, HeadAsGet, RequestMetrics
from server.api.openapi import install_openapi
from server.api.response_store import ResponseStore
from server.api.routes import chat, completions, health, lora_admin, messages, models, responses, router_compat, sessions, tokenize
from server.api.routes import embeddings, rerank
from server.api.serving import ServingContext
from server.api.serving_pooling import PoolingContext
from server.metrics import Metrics
from server.model_loader import LoadedModel
from server.settings import Settings


@dataclass(frozen=True)
class Lifecycle:
    """What the app asks of the composition root (server/startup.py's functions of these names)."""

    start: Callable[[Settings, Metrics, LoadedModel | None], Awaitable[ServingContext]]
    failed: Callable[[BaseException], tuple[int, str]]  # (exit status, reason) of a start-up error
    close: Callable[[ServingContext, float], None]
    response_store: Callable[[Settings], ResponseStore]


class AppState:
    """Lives on `app.state.kv`: the serving context once ready, and the lifecycle flags."""

    def __init__(self, settings: Settings, metrics: Metrics, lifecycle: Lifecycle) -> None:
        self.settings = settings
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.responses = lifecycle.response_store(settings)
        self.ctx: ServingContext | PoolingContext | None = None  # by --task: generation or pooling
        self.load_error: str | None = None  # for the log and the process, never sent to clients
        self.exit_status: int | None = None  # set with load_error: the status `serve` exits with
        self.draining = False

    @property
    def body_limit(self) -> int:
        """The largest request body: --max-body-bytes, plus room for --max-request-image-bytes of
        images written as base64 data: URLs once a vision-language model serves."""
        limit = self.settings.max_body_bytes
        if self.ctx is not None and self.ctx.vision is not None:
            limit += 4 * -(-self.settings.max_request_image_bytes // 3)
        return limit

    @property
    def ready(self) -> bool:
        return self.ctx is not None and not self.draining and self.ctx.engine.dead is None

    @property
    def fatal(self) -> tuple[int, str] | None:
        """(exit status, reason) once the process cannot serve any more: the model failed to
        start, or the engine died while serving; None while it can (or still may)."""
        if self.exit_status is not None:
            return self.exit_status, self.load_error or ""
        if self.ctx is not None and self.ctx.engine.dead is not None:
            return exits.ENGINE_DEAD, f"the engine died: {self.ctx.engine.dead}"
        return None

    def drain(self) -> bool:
        """Refuse new requests (503 `shutting_down`, /ready 503); admitted ones run on.

        True once the engine holds no request (also before the model is loaded).
        """
        self.draining = True
        if self.ctx is None:
            return True
        self.ctx.engine.drain()
        return self.ctx.engine.idle

    def abort_in_flight(self) -> None:
        """End every request still in the engine now (finish_reason `abort`); blocks until the
        engine thread has stopped (at most one prefill chunk or decode step)."""
        self.draining = True
        if self.ctx is not None:
            self.lifecycle.close(self.ctx, self.settings.shutdown_grace_s)

    def require_ctx(self) -> ServingContext:
        """The generation context; 400 on a server started for a pooling task (--task embed, rerank)."""
        ctx = self.require_served()
        if isinstance(ctx, PoolingContext):
            what = {"embed": "embeddings (/v1/embeddings)", "rerank": "reranking (/v1/rerank, /v1/score)"}[ctx.task]
            raise APIError(400, f"this server serves the model '{ctx.model_id}' for {what} (--task {ctx.task}), not for generation: "
                           "start kvserve with --task generate and a generative model for chat, completions, Responses and Messages",
                           code="task_not_served", rejection="bad_request")
        return ctx

    def require_pooling(self, task: str, route: str) -> PoolingContext:
        """The pooling context of `task` ("embed", "rerank"); 400 on a server started for another task."""
        ctx = self.require_served()
        if not isinstance(ctx, PoolingContext) or ctx.task != task:
            served = "generation" if isinstance(ctx, ServingContext) else f"--task {ctx.task}"
            kind = {"embed": "an embedding model", "rerank": "a reranker (a cross-encoder or a Qwen3-Reranker-style decoder)"}[task]
            raise APIError(400, f"{route} needs a server started with --task {task} and {kind}; this one serves the model "
                           f"'{ctx.model_id}' for {served}", code="task_not_served", rejection="bad_request")
        return ctx

    def require_served(self) -> ServingContext | PoolingContext:
        """The context the server serves with, whatever its task; 503 while it cannot serve."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "1"})
        if self.ctx is None and self.load_error is not None:
            raise APIError(503, "the model failed to load; see the server log", code="model_unavailable")
        if self.ctx is not None and self.ctx.engine.dead is not None:
            raise APIError(503, "the model stopped running; the server is exiting to be restarted (see its log)", code="model_unavailable")
        if self.ctx is None:
            raise APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})
        return self.ctx


async def _load(state: AppState, loaded: LoadedModel | None) -> None:
    try:
        state.ctx = await state.lifecycle.start(state.settings, state.metrics, loaded)
    except Exception as exc:  # no request can fix it: `serve` exits with its status
        state.exit_status, state.load_error = state.lifecycle.failed(exc)


def create_app(settings: Settings, lifecycle: Lifecycle, loaded: LoadedModel | None = None) -> FastAPI:
    """The app; `loaded` lets tests share one already loaded model between apps."""
    metrics = Metrics()
    state = AppState(settings, metrics, lifecycle)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics_server = None
        if settings.metrics_port is not None:
            metrics_server, _ = start_http_server(settings.metrics_port, addr=settings.host, registry=metrics.registry)
        await asyncio.to_thread(state.responses.load)
        loader = asyncio.create_task(_load(state, loaded))
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.to_thread(state.abort_in_flight)
            await asyncio.to_thread(state.responses.close)
            if metrics_server is not None:
                await asyncio.to_thread(metrics_server.shutdown)
                metrics_server.server_close()

    # NOTE: no trailing-slash redirects: Starlette's 307 has no body and a Location built from
    # the client's Host header. A trailing slash is a 404 in the error shape instead.
    app = FastAPI(title="kvserve", version=VERSION, lifespan=lifespan, redirect_slashes=False)
    app.state.kv = state
    install_handlers(app)
    for module in (health, models, chat, completions, responses, messages, sessions, tokenize, router_compat):
        app.include_router(module.router)
    for module in (embeddings, rerank):  # the pooling tasks' routes (a 400 on a server of another task)
        app.include_router(module.router)
    if settings.enable_lora_loading:  # otherwise the routes do not exist (404, as vLLM without runtime updating)
        app.include_router(lora_admin.router)
    install_openapi(app)
    metrics.watch_response_store(state.responses)
    # The last added runs first: metrics see every request, auth runs before any body is read.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimit, limit=lambda: state.body_limit)
    app.add_middleware(Auth, keys=settings.api_keys(), metrics=metrics)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app
