"""create_app(settings) -> FastAPI.

The lifespan starts loading the model in the background, so the process answers /health at once
and /ready turns 200 only after the model is loaded and one warm-up generation step has run.
Routes that need the model answer 503 `model_loading` until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from prometheus_client import start_http_server

from cache_manager import disk as disk_files
from cache_manager.manager import CacheConfig, CacheManager
from cache_manager.tiers import DiskTier, HostTier, budget_from_free_space
from grammars import GrammarCompiler, GrammarSpec
from server import __version__ as VERSION
from server.engine.draft_model import DraftModelProposer, check_compatible, draft_budget_for
from server.engine import exact, families
from server.engine.core import Engine, EngineConfig
from server.api import reasoning
from server.api.errors import APIError, install_handlers
from server import kv_budget
from server.metrics import Metrics
from server.api.middleware import Auth, BodyLimit, HeadAsGet, RequestMetrics
from server.model_loader import LoadedModel, load_model
from server.api.openapi import install_openapi
from server.engine.prompt_lookup import NgramProposer
from server.api.response_store import ResponseStore
from server.api.routes import chat, completions, health, models, responses, router_compat, sessions
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.api.serving import ServingContext
from server.settings import Settings
from server.engine.speculative import SpeculativeConfig

log = logging.getLogger(__name__)


class AppState:
    """Lives on `app.state.kv`: the serving context once ready, and the lifecycle flags."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.responses = response_store(settings)
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None  # for the log and the process, never sent to clients
        self.draining = False

    @property
    def ready(self) -> bool:
        return self.ctx is not None and not self.draining

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
            self.ctx.engine.stop()
            # Sessions outlive the process: written to the disk tier, if there is one.
            self.ctx.cache_manager.close(timeout_s=max(5.0, self.settings.shutdown_grace_s))

    def require_ctx(self) -> ServingContext:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "1"})
        if self.ctx is None and self.load_error is not None:
            raise APIError(503, "the model failed to load; see the server log", code="model_unavailable")
        if self.ctx is None:
            raise APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})
        return self.ctx


def response_store(settings: Settings) -> ResponseStore:
    """The stored responses; on disk beside the KV tier's files when the disk tier is on, so a
    response and its session survive a restart together."""
    directory = settings.kv_disk_dir / "responses" if settings.kv_disk_dir is not None else None
    return ResponseStore(settings.response_store_bytes, directory)


def numerics(settings: Settings, loaded: LoadedModel) -> str:
    """What the KV and logits bits depend on besides the model, dtype and device: "" in the
    default mode (its near-tie rule allows other rounding); in exact mode "deterministic",
    the platform and on CUDA the attention it runs (`exact.pin_backends`, which pins its
    settings here, before the first matmul)."""
    if not settings.deterministic:
        return ""
    return f"deterministic:{exact.pin_backends(loaded.device, loaded.dtype)}"


def kv_tiers(settings: Settings, loaded: LoadedModel, metrics: Metrics, mode: str) -> tuple[HostTier | None, DiskTier | None]:
    """The KV tiers below the device the settings ask for (host memory only on CUDA); `mode`:
    `numerics`."""
    disk = None
    if settings.kv_disk_dir is not None:
        budget = settings.kv_disk_bytes or budget_from_free_space(settings.kv_disk_dir)
        # NOTE: exact mode computes other KV bits than the default mode (and its fallback
        # attention than its kernel): a session file of one is never restored into another
        fingerprint = disk_files.fingerprint(loaded.model, loaded.dtype, mode)
        disk = DiskTier(settings.kv_disk_dir, budget, settings.session_ttl_s, fingerprint, metrics, kv_dtype=settings.kv_cache_dtype)
    host = None
    if settings.kv_host_bytes > 0:
        if loaded.device.type == "cuda":
            host = HostTier(settings.kv_host_bytes, settings.session_ttl_s, below=disk, metrics=metrics)
        else:
            log.warning("--kv-host-bytes ignored: on %s the KV already lives in host memory", loaded.device.type)
    return host, disk


def proposer(settings: Settings, loaded: LoadedModel, draft: LoadedModel | None, max_context: int, draft_bytes: int):
    """The --speculative proposer, chosen once (None: no speculation)."""
    if settings.speculative == "ngram":
        return NgramProposer(settings.speculative_ngram_min, settings.speculative_ngram_max)
    if settings.speculative == "draft":
        check_compatible(loaded.model, loaded.tokenizer, draft.model, draft.tokenizer)
        return DraftModelProposer(draft.model, max_context, draft_bytes, packed=settings.cpu_packed_weights, exact=settings.deterministic)
    return None


def build_context(settings: Settings, loaded: LoadedModel, metrics: Metrics, draft: LoadedModel | None = None) -> ServingContext:
    # a family whose features the engine does not model is refused here, by name, before any
    # cache is sized for it (server/engine/families.py)
    families.check(loaded.model)
    if draft is not None:
        families.check(draft.model)
    max_context = min(loaded.max_context, settings.max_model_len or loaded.max_context)
    mode = numerics(settings, loaded)
    host, disk = kv_tiers(settings, loaded, metrics, mode)
    budget = kv_budget.choose(settings, loaded.model, loaded.device, max_context)
    # a draft model's caches (running and kept for sessions) take their share of the budget
    draft_bytes = draft_budget_for(loaded.model, draft.model, budget.nbytes, max_context, settings.kv_cache_dtype) if settings.speculative == "draft" else 0
    kv_budget.check(budget, budget.nbytes - draft_bytes, loaded.model.config, loaded.dtype, settings.kv_cache_dtype, max_context)
    cache_manager = CacheManager(
        loaded.model.config,
        loaded.device,
        loaded.dtype,
        max_context,
        CacheConfig(
            budget_bytes=budget.nbytes - draft_bytes,
            ttl_s=settings.session_ttl_s,
            anonymous_reuse=settings.anonymous_reuse,
            reuse=settings.session_reuse,
            persist_every_s=settings.kv_persist_interval_s,
            kv_dtype=settings.kv_cache_dtype,
        ),
        metrics=metrics,
        host=host,
        disk=disk,
    )
    metrics.watch_tiers(cache_manager)
    pool = cache_manager.pool
    log.info("KV budget %.2f GiB (%s): %d tokens of %s KV (%d bytes per token); one sequence at the full context of "
             "%d tokens takes %.1f%% of it", budget.nbytes / 2**30, budget.how, pool.capacity_tokens,
             pool.format.name, pool.block_bytes // pool.block_size, max_context, 100 * max_context / max(pool.capacity_tokens, 1))
    log.info("KV pool on %s: %d blocks of %d tokens, %.2f GiB (%d tokens)", pool.device, pool.num_blocks,
             pool.block_size, pool.num_blocks * pool.block_bytes / 2**30, pool.capacity_tokens)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(
            max_context=max_context,
            max_queue=settings.max_queue,
            max_running=settings.max_running,
            max_batch_tokens=settings.max_batch_tokens,
            reject_busy_sessions=settings.reject_busy_sessions,
            speculative=SpeculativeConfig(max_draft=settings.speculative_max_draft),
            cpu_packed_weights=settings.cpu_packed_weights,
            cuda_graphs=settings.cuda_graphs,
            deterministic=settings.deterministic,
        ),
        cache_manager,
        metrics=metrics,
        proposer=proposer(settings, loaded, draft, max_context, draft_bytes),
    )
    compiler = GrammarCompiler(
        loaded.tokenizer,
        loaded.model.config.get_text_config(decoder=True).vocab_size,
        eos_token_ids=sorted(engine.eos_ids),
        cache_size=settings.grammar_cache_size,
        compile_timeout_s=settings.grammar_compile_timeout_s,
        flexible_whitespace=settings.json_whitespace_flexible,
        on_compile=metrics.grammar_compile_seconds.observe,
    )
    metrics.watch_grammar_cache(compiler)
    dtype = str(loaded.dtype).removeprefix("torch.")
    metrics.info.info({"model": loaded.model_id, "dtype": dtype, "device": loaded.device.type, "version": VERSION})
    numbers = f":{mode}" if mode else ""  # other numerics, another fingerprint
    fingerprint = "fp_" + hashlib.sha256(f"{VERSION}:{loaded.model_id}:{dtype}:{loaded.device.type}{numbers}".encode()).hexdigest()[:10]
    return ServingContext(
        engine=engine,
        cache_manager=cache_manager,
        compiler=compiler,
        tokenizer=loaded.tokenizer,
        metrics=metrics,
        model_id=settings.served_model_name or loaded.model_id,
        model_aliases=frozenset(settings.model_aliases) | {loaded.model_id},
        max_context=max_context,
        vocab_size=loaded.model.config.get_text_config(decoder=True).vocab_size,
        max_tokens_default=settings.max_tokens_default,
        request_timeout_s=settings.request_timeout_s,
        fingerprint=fingerprint,
        deterministic=settings.deterministic,
        reasoning=reasoning.reasoning_format(loaded.tokenizer, None if settings.reasoning_parser == "auto" else settings.reasoning_parser),
        max_reasoning_tokens=settings.max_reasoning_tokens,
    )


async def warm_up(ctx: ServingContext) -> None:
    """Real generation steps through the engine, plain and grammar-constrained, so the first
    request pays for no lazy initialisation (mask buffers, worker threads, kernels)."""
    grammar = await asyncio.to_thread(ctx.compiler.compile, GrammarSpec("json_object"))
    for g in (None, grammar):
        request = GenerationRequest(
            "warmup", ctx.tokenizer("Hello")["input_ids"], SamplingParams(max_tokens=2, temperature=0.0),
            use_session=False, grammar=g,
        )
        async for _ in ctx.engine.submit(request, asyncio.get_running_loop()):
            pass


async def _in_own_thread(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) on a thread that ends with it.

    NOTE: not the event loop's executor, whose threads stay: loading runs multi-threaded torch
    ops, and a thread that did keeps its OpenMP team while it lives, which slows every engine
    step down (docs/architecture.md, "One OpenMP team")."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))
    finally:
        pool.shutdown(wait=False)


async def _load(state: AppState, loaded: LoadedModel | None) -> None:
    s = state.settings
    try:
        if loaded is None:
            loaded = await _in_own_thread(
                load_model, s.model, cache_dir=s.cache_dir, device=s.device, dtype=s.dtype,
                trust_remote_code=s.trust_remote_code,
            )
        draft = None
        if s.speculative == "draft":
            draft = await _in_own_thread(
                load_model, s.draft_model, cache_dir=s.cache_dir, device=s.device, dtype=s.dtype,
                trust_remote_code=s.trust_remote_code,
            )
        ctx = build_context(s, loaded, state.metrics, draft)
        await asyncio.to_thread(ctx.engine.start)  # waits for the engine thread to prepare the models
        await warm_up(ctx)
        state.ctx = ctx
        log.info("ready: %s on %s (%s)", ctx.model_id, loaded.device, loaded.dtype)
    except kv_budget.KVBudgetError as exc:  # the operator's to fix: the message says how
        state.load_error = str(exc)
        log.error("cannot start: %s", exc)
    except Exception as exc:  # surfaced on /ready; the process stays up for inspection
        state.load_error = str(exc)
        log.exception("model load failed")


def create_app(settings: Settings, loaded: LoadedModel | None = None) -> FastAPI:
    """The app; `loaded` lets tests share one already loaded model between apps."""
    metrics = Metrics()
    state = AppState(settings, metrics)

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
    for module in (health, models, chat, completions, responses, sessions, router_compat):
        app.include_router(module.router)
    install_openapi(app)
    metrics.watch_response_store(state.responses)
    # The last added runs first: metrics see every request, auth runs before any body is read.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Auth, keys=settings.api_keys(), metrics=metrics)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app
