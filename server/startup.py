"""The composition root: the model, the engine, the cache manager and everything else a server
serves with, built from `Settings` into one `ServingContext` (`start`), and taken down again
(`close`). `create_app` is the HTTP app (server/api/app.py, which only wires routes) over it;
`kvserve serve --check` (`startup_check`) runs the same start without HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

from cache_manager import disk as disk_files
from cache_manager import kv, state
from cache_manager.manager import CacheConfig, CacheManager, make_pool
from cache_manager.tiers import DiskTier, HostTier, budget_from_free_space
from grammars import GrammarCompiler, GrammarSpec
from server import __version__ as VERSION
from server import exits, kv_budget, memory, model_loader, parallel
from server.api import app, dialect, vision_prompt
from server.api.media import MediaLimits
from server.api.response_store import ResponseStore
from server.api.serving import ServingContext
from server.api.serving_pooling import PoolingContext
from server.engine import compiled, exact, faults, families, lockstep, lora, mla
from server.engine.core import Engine, EngineConfig, serving_runner
from server.engine.draft_model import DraftModelProposer, check_compatible, draft_budget_for
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from server.metrics import Metrics
from server.model_loader import LoadedModel, load_model
from server.settings import Settings
from server.startup_pooling import build_pooling_context, warm_up_pooling

log = logging.getLogger(__name__)


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


def load_adapters(settings: Settings, loaded: LoadedModel, served: set[str]) -> lora.Adapters | None:
    """The --lora adapters, read and checked against the base model, and their device slots
    allocated (before any cache is sized, so the KV budget counts them); None without --lora
    and --enable-lora-loading. An adapter that cannot be served, or whose name is already a
    served model id (`served`), is a start-up error (exit status 2, a flag to change) naming
    it and the reason."""
    if not settings.serves_adapters:
        return None
    adapters = lora.Adapters(loaded.model, max_loras=settings.max_loras, max_rank=settings.max_lora_rank,
                             max_loaded=settings.lora_capacity, reserve=settings.enable_lora_loading)
    for name, path in settings.lora_adapters():
        try:
            adapters.load(name, path, served)
        except lora.AdapterError as exc:
            raise exits.StartupError(exits.SETTINGS, f"--lora {name}={path}: cannot serve this adapter ({exc.reason}): {exc}") from exc
    adapters.allocate()
    log.info("LoRA: %d device slots of rank %d over %d linear layers (%.1f MiB)%s", len(adapters.slots), adapters.rank,
             len(adapters.modules), adapters.nbytes / 2**20, ", adapters loadable at run time from " + str(settings.lora_dir) if settings.enable_lora_loading else "")
    return adapters


def build_context(settings: Settings, loaded: LoadedModel, metrics: Metrics, draft: LoadedModel | None = None) -> ServingContext:
    """The serving context of `loaded` (and its draft model): the model's family checked, its
    adapters loaded, the KV budget sized, the cache manager, engine and grammar compiler built.
    The engine is not started yet (`start` does)."""
    check_family(settings, loaded)
    if draft is not None:
        families.check(draft.model)
        if state.spec(draft.model.config, draft.dtype) is not None:
            families.check_hybrid_modes(speculative=False, exact=False, draft=True)
    model_id = settings.served_model_name or loaded.model_id
    model_aliases = frozenset(settings.model_aliases) | {loaded.model_id}
    adapters = load_adapters(settings, loaded, {model_id, *model_aliases})
    max_context = loaded.context_length(settings.max_model_len)
    mode = numerics(settings, loaded)
    budget, pool_bytes, draft_bytes, ranks = size_pool(settings, loaded, max_context, draft)
    cache_manager = build_cache_manager(settings, loaded, metrics, max_context, pool_bytes, mode)
    log.info("KV budget %.2f GiB (%s): %d tokens of %s KV (%d bytes per token); one sequence at the full context of "
             "%d tokens takes %.1f%% of it", budget.nbytes / 2**30, budget.how, cache_manager.capacity_tokens(),
             cache_manager.pool.format.name, cache_manager.pool.block_bytes // cache_manager.pool.block_size, max_context,
             100 * max_context / max(cache_manager.capacity_tokens(), 1))
    if adapters is not None:
        metrics.watch_adapters(adapters)
    children, group, leader = parallel.children(), parallel.group(), None
    if group is not None:
        leader = lockstep.Leader(group.control, group.rank.world, children.lost if children is not None else lambda: None)
        cache_manager.pool.peers = leader  # the tiers reach every rank's pool through rank 0's
    for shard in ranks or [{"rank": 0, "weights_bytes": weights_bytes(loaded.model)}]:
        metrics.rank_memory_bytes.labels(str(shard["rank"]), "weights").set(shard["weights_bytes"])
    engine = Engine(loaded.model, loaded.tokenizer, engine_config(settings, max_context), cache_manager, metrics=metrics,
                    proposer=proposer(settings, loaded, draft, max_context, draft_bytes), adapters=adapters, lockstep=leader)
    metrics.watch_engine(engine)
    vocab_size = loaded.model.config.get_text_config(decoder=True).vocab_size
    compiler = GrammarCompiler(
        loaded.tokenizer,
        vocab_size,
        eos_token_ids=sorted(engine.eos_ids),
        cache_size=settings.grammar_cache_size,
        cache_bytes=settings.grammar_cache_bytes,
        compile_timeout_s=settings.grammar_compile_timeout_s,
        flexible_whitespace=settings.json_whitespace_flexible,
        on_compile=metrics.grammar_compile_seconds.observe,
    )
    metrics.watch_grammar_cache(compiler)
    return ServingContext(
        engine=engine,
        cache_manager=cache_manager,
        compiler=compiler,
        tokenizer=loaded.tokenizer,
        metrics=metrics,
        model_id=model_id,
        model_aliases=model_aliases,
        max_context=max_context,
        vocab_size=vocab_size,
        max_tokens_default=settings.max_tokens_default,
        request_timeout_s=settings.request_timeout_s,
        fingerprint=fingerprint(loaded, metrics, mode),
        dialect=dialect.read(loaded.tokenizer, None if settings.reasoning_parser == "auto" else settings.reasoning_parser),
        max_reasoning_tokens=settings.max_reasoning_tokens,
        max_request_tokens=settings.max_request_tokens,
        adapters=adapters,
        vision=vision(settings, loaded, engine),
        ranks=ranks,
    )


def check_family(settings: Settings, loaded: LoadedModel) -> None:
    """Refuse, by name, a family whose features the engine does not model, before any cache is
    sized for it (server/engine/families.py); an MLA model's pool keeps its latent where it can
    (server/engine/mla.py). On every rank (its probe runs the sharded forward)."""
    # NOTE: a sharded MLA model keeps its heads (each rank its share); the latent is one
    mla.configure(loaded.model, settings.mla_cache if parallel.group() is None else "heads", lora=settings.serves_adapters)
    families.check(loaded.model)


def size_pool(settings: Settings, loaded: LoadedModel, max_context: int,
              draft: LoadedModel | None = None) -> tuple[kv_budget.Budget, int, int, list[dict] | None]:
    """This rank's KV budget (`rank_budget`), the bytes of its pool, a draft model's share of the
    budget (its caches, running and kept for sessions: on rank 0 alone) and every rank's summary
    (None alone). With tensor parallel every rank's pool gets rank 0's bytes, so every pool has
    the same blocks. Rank 0 (`build_context`) and the others (`follow`) both size theirs here:
    the same collectives in the same order."""
    budget, ranks = rank_budget(settings, loaded, max_context)
    draft_bytes = 0
    if draft is not None and settings.speculative == "draft":
        draft_bytes = draft_budget_for(loaded.model, draft.model, budget.nbytes, max_context, settings.kv_cache_dtype)
    pool_bytes = budget.nbytes - draft_bytes
    if (group := parallel.group()) is not None:
        pool_bytes = group.share(pool_bytes if group.rank.rank == 0 else None)
    kv_budget.check(budget, pool_bytes, loaded.model.config, loaded.dtype, settings.kv_cache_dtype, max_context)
    return budget, pool_bytes, draft_bytes, ranks


def rank_budget(settings: Settings, loaded: LoadedModel, max_context: int) -> tuple[kv_budget.Budget, list[dict] | None]:
    """The KV budget of this rank's pool (`kv_budget.choose`); with tensor parallel the one every
    rank can hold (the smallest; on CPU each rank's share of this node's RAM), and every rank's
    summary (its device, weights and budget: `serve --check`), else None."""
    budget = kv_budget.choose(settings, loaded.model, loaded.device, max_context)
    group = parallel.group()
    if group is None:
        return budget, None
    if loaded.device.type == "cpu" and settings.kv_budget_bytes is None:
        budget = kv_budget.Budget(budget.nbytes // group.rank.local_world, f"{budget.how}, shared by {group.rank.local_world} ranks")
    weights = weights_bytes(loaded.model)
    shard = {"host": socket.gethostname(), "device": str(loaded.device), "weights_bytes": weights,
             "kv_heads": kv.layout(loaded.model.config).kv_heads}
    nbytes, ranks = group.agree(budget.nbytes, shard)
    return kv_budget.Budget(nbytes, f"{budget.how}; the smallest of {group.rank.world} ranks'" if nbytes < budget.nbytes else budget.how), ranks


def weights_bytes(model) -> int:
    """The bytes of this rank's weights (a tensor-parallel shard's: local tensors, sharding.localize)."""
    return sum(p.nbytes for p in model.parameters())


def follow(settings: Settings) -> int:
    """A tensor-parallel follower (server/parallel.py): load this rank's shard, check it and size
    its pool through what rank 0's `build_context` calls (the same collectives in the same
    order), build the runner as the engine does, then run the forwards rank 0 sends until it
    stops. Returns the exit status."""
    s = settings
    try:
        device = model_loader.resolve_device_dtype(s.device, s.dtype)[0]
        group = parallel.join(s, device.type)
        loaded = load_model(s.model, cache_dir=s.cache_dir, device=s.device, dtype=s.dtype, trust_remote_code=s.trust_remote_code,
                            task=s.task, tensor_parallel=s.tensor_parallel_size)
        if faults.switched_on("rank"):
            raise exits.StartupError(exits.MODEL_CANNOT_RUN, f"injected: rank {group.rank.rank} cannot start")
        check_family(s, loaded)
        max_context = loaded.context_length(s.max_model_len)
        pool_bytes = size_pool(s, loaded, max_context)[1]
        pool = make_pool(loaded.model.config, pool_bytes, loaded.device, loaded.dtype, s.kv_cache_dtype, max_context)
        runner = serving_runner(loaded.model, engine_config(s, max_context), pool)
        runner.prepare()
    except Exception as exc:
        status, reason = failed(exc)
        print(f"kvserve: rank {parallel.rank_of(s).rank}: exiting with status {status} ({exits.STATUSES[status]}): {reason}",
              file=sys.stderr)
        return status
    if (children := parallel.children()) is not None:
        children.ready = True
    _freeze(True)
    log.info("rank %d of %d follows rank 0 over %s", group.rank.rank, group.rank.world, group.backend)
    try:
        lockstep.follow(runner, group.control)
    except Exception as exc:  # noqa: BLE001 - rank 0 is gone or stopped answering, or a forward failed here
        log.critical("rank %d cannot follow rank 0 any more: %s: %s", group.rank.rank, type(exc).__name__, exc, exc_info=True)
        return exits.ENGINE_DEAD
    log.info("rank %d stopped", group.rank.rank)
    return exits.OK


def engine_config(settings: Settings, max_context: int) -> EngineConfig:
    """The engine's settings (and, with --compile, where compiled kernels are cached)."""
    if settings.compile != "off":
        compiled.use_cache_dir(settings.cache_dir)  # before the first compilation reads it
    return EngineConfig(
        max_context=max_context,
        max_queue=settings.max_queue,
        max_running=settings.max_running,
        max_batch_tokens=settings.max_batch_tokens,
        reject_busy_sessions=settings.reject_busy_sessions,
        speculative=SpeculativeConfig(max_draft=settings.speculative_max_draft),
        cpu_packed_weights=settings.cpu_packed_weights,
        cuda_graphs=settings.cuda_graphs != "off",
        compile=settings.compile,
        overlap=None if settings.overlap == "auto" else settings.overlap == "on",
        exact=settings.deterministic,
        encoder_cache_bytes=settings.encoder_cache_bytes,
    )


def vision(settings: Settings, loaded: LoadedModel, engine: Engine) -> vision_prompt.Vision | None:
    """A vision-language model's image handling: its processor, and the image limits and
    fetching the settings allow; None for a text-only model."""
    if loaded.processor is None or engine.runner.encoder is None:
        return None
    limits = MediaLimits(
        max_image_bytes=settings.max_image_bytes, max_request_image_bytes=settings.max_request_image_bytes,
        max_images=settings.max_images_per_request, max_pixels=settings.max_image_pixels,
        allowed_domains=tuple(settings.allowed_media_domains), fetch_timeout_s=settings.media_fetch_timeout_s,
    )
    encoder = engine.runner.encoder
    return vision_prompt.Vision(loaded.processor, encoder.placeholder, limits, span=encoder.span)


def build_cache_manager(settings: Settings, loaded: LoadedModel, metrics: Metrics, max_context: int, budget_bytes: int, mode: str) -> CacheManager:
    """The cache manager over a KV pool of `budget_bytes`, with the tiers below it the settings
    ask for; `mode`: `numerics`."""
    host, disk = kv_tiers(settings, loaded, metrics, mode)
    cache_manager = CacheManager(
        loaded.model.config,
        loaded.device,
        loaded.dtype,
        max_context,
        CacheConfig(
            budget_bytes=budget_bytes,
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
    log.info("KV pool on %s: %d blocks of %d tokens, %.2f GiB (%d tokens)", pool.device, pool.num_blocks,
             pool.block_size, pool.num_blocks * pool.block_bytes / 2**30, cache_manager.capacity_tokens())
    if pool.states is not None:
        log.info("recurrent state: %s; %d slots (%.2f GiB) for running and kept sequences and their checkpoints",
                 pool.states.spec.describe(), pool.states.num_slots, pool.states.num_slots * pool.states.spec.nbytes / 2**30)
    return cache_manager


def fingerprint(loaded: LoadedModel, metrics: Metrics, mode: str) -> str:
    """`system_fingerprint`: the version, model, dtype, device and numerics (`mode`) the outputs
    depend on; also reported in the `kvserve_info` metric."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    metrics.info.info({"model": loaded.model_id, "dtype": dtype, "device": loaded.device.type, "version": VERSION})
    numbers = f":{mode}" if mode else ""  # other numerics, another fingerprint
    return "fp_" + hashlib.sha256(f"{VERSION}:{loaded.model_id}:{dtype}:{loaded.device.type}{numbers}".encode()).hexdigest()[:10]


async def warm_up(ctx: ServingContext) -> None:
    """Real generation steps through the engine, plain and grammar-constrained, so the first
    request pays for no lazy initialisation (mask buffers, worker threads, kernels). Raises
    StartupError when one fails: a server whose requests fail is never reported ready.

    NOTE: the prompt's ids are taken modulo the model's vocabulary: a tiny test model may have
    fewer embeddings than its tokenizer has tokens."""
    grammar = await asyncio.to_thread(ctx.compiler.compile, GrammarSpec("json_object"))
    prompt = [t % ctx.vocab_size for t in ctx.tokenizer("Hello")["input_ids"]] or [0]
    for g in (None, grammar):
        request = GenerationRequest(
            "warmup", prompt, SamplingParams(max_tokens=2, temperature=0.0), use_session=False, grammar=g,
        )
        async for output in ctx.engine.submit(request, asyncio.get_running_loop()):
            if output.error is not None:
                what = "grammar-constrained " if g is not None else ""
                raise exits.StartupError(exits.MODEL_CANNOT_RUN, f"a {what}warm-up request failed ({output.error}); the server log says why")


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


def report_paths(ctx: ServingContext, metrics: Metrics, settings: Settings) -> None:
    """Show how the engine runs (/metrics' kvserve_engine_paths, /v1/models' `engine` block);
    refuse a required path that is not in use."""
    runner = ctx.engine.runner
    paths = {**runner.paths, "speculative": settings.speculative}
    if (group := parallel.group()) is not None:
        paths["tensor_parallel"] = f"{group.rank.world} ranks over {group.backend}"
    metrics.engine_paths.info({**paths, "fallbacks": ",".join(sorted(runner.fallbacks))})
    ctx.engine_paths = {**paths, "fallbacks": dict(runner.fallbacks)}
    if settings.compile == "require" and paths.get("compile") not in ("decode", "decode+mixed"):
        why = runner.fallbacks.get("compile", "")
        raise exits.StartupError(exits.REQUIRED_PATH, f"--compile=require, but the decode forward is not compiled: {why}")
    if settings.cuda_graphs == "require" and paths.get("cuda_graphs") != "captured":
        why = runner.fallbacks.get("cuda_graphs") or f"they need CUDA and the paged path (this device: {runner.device.type})"
        raise exits.StartupError(exits.REQUIRED_PATH, f"--cuda-graphs=require, but no CUDA graph was captured: {why}")


async def start(settings: Settings, metrics: Metrics, loaded: LoadedModel | None = None) -> ServingContext:
    """Load the model (unless `loaded` is given) and the draft model, build the serving context,
    start the engine (its start-up forward pass), report its paths and warm up: the context a
    ready server serves with. A failure stops what had started and raises; `failed` gives the
    exit status."""
    s = settings
    ctx, started = None, False
    try:
        draft = None
        if s.speculative == "draft":  # NOTE: first: the other tensor-parallel ranks would wait for it
            draft = await _in_own_thread(
                load_model, s.draft_model, cache_dir=s.cache_dir, device=s.device, dtype=s.dtype,
                trust_remote_code=s.trust_remote_code,
            )
        own = loaded is None  # a serving process: a test hands in a model it shares
        if own:
            if s.tensor_parallel_size > 1:  # the other ranks meet here first (server/parallel.py)
                device = model_loader.resolve_device_dtype(s.device, s.dtype)[0]
                await _in_own_thread(parallel.join, s, device.type)
            loaded = await _in_own_thread(
                load_model, s.model, cache_dir=s.cache_dir, device=s.device, dtype=s.dtype,
                trust_remote_code=s.trust_remote_code, task=s.task, tensor_parallel=s.tensor_parallel_size,
            )
        if loaded.task != "generate":  # a pooling task: no KV cache, no generation engine
            ctx = build_pooling_context(s, loaded, metrics)
            ctx.engine.start()
            await warm_up_pooling(ctx)
            _freeze(own)
            log.info("ready: %s on %s (%s) for --task %s", ctx.model_id, loaded.device, loaded.dtype, loaded.task)
            return ctx
        ctx = build_context(s, loaded, metrics, draft)
        await asyncio.to_thread(ctx.engine.start)  # the models prepared, the start-up forward pass run
        started = True
        report_paths(ctx, metrics, s)
        await warm_up(ctx)
    except BaseException:
        if ctx is not None:
            # the other ranks follow rank 0's steps once its engine started: told to end then
            if await asyncio.to_thread(ctx.engine.stop) and started and ctx.engine.dead is None:
                stop_ranks(ctx.engine)
        raise
    if (children := parallel.children()) is not None:
        children.ready = True  # a rank lost from here on is the engine's to report
    _freeze(own)
    log.info("ready: %s on %s (%s)", ctx.model_id, loaded.device, loaded.dtype)
    return ctx


def _freeze(own: bool) -> None:
    """Take the start-up heap out of the garbage collector's full collections
    (`memory.freeze_heap`), in a process that loaded its model itself: a serving process, not
    a test sharing one model between apps."""
    if own and (frozen := memory.freeze_heap()):
        log.info("%d objects alive at start-up frozen out of the garbage collector's full collections", frozen)


def failed(exc: BaseException) -> tuple[int, str]:
    """(exit status, reason) of a start-up failure, logged (with its traceback when it is not
    one of the errors server/exits.py names). Call it in the `except` block."""
    status = exits.status_of(exc)
    if status == exits.FAILED:
        log.exception("cannot start")
    else:
        log.error("cannot start: %s", exc)
    return status, str(exc)


def close(ctx: ServingContext, grace_s: float) -> None:
    """End every request still in the engine now (finish_reason `abort`), stop the engine
    thread and close the cache manager, whose sessions go to the disk tier if there is one;
    then stop the other tensor-parallel ranks."""
    if isinstance(ctx, PoolingContext):  # no sessions: its queued requests fail with 503
        ctx.engine.stop()
        return
    ended = ctx.engine.stop()
    # NOTE: with tensor parallel writing the sessions gathers every rank's KV: only while the
    # ranks are in step (the engine thread ended cleanly) and before they are told to stop
    in_step = ended and ctx.engine.dead is None
    if ended:  # no step runs any more: the graphs and buffers go, as the pool's storage does below
        ctx.engine.runner.release()
    try:
        ctx.cache_manager.close(timeout_s=max(5.0, grace_s), release=ended, persist=in_step or ctx.engine.runner.lockstep is None)
    except lockstep.RankLost as exc:
        log.warning("the sessions were not all written at shutdown: %s", exc)
    finally:
        if in_step:
            stop_ranks(ctx.engine)


def stop_ranks(engine: Engine) -> None:
    """Tell the other tensor-parallel ranks to end (their engine thread has ended, cleanly);
    nothing without tensor parallel."""
    if engine.runner.lockstep is not None:
        engine.runner.lockstep.stop()


async def startup_check(settings: Settings) -> tuple[dict | None, tuple[int, str] | None]:
    """`kvserve serve --check`: load and start as `serve` would (the KV budget sized, the
    start-up forward pass and the warm-up run), then stop. Returns (what it would serve with,
    None) or (None, (exit status, reason))."""
    try:
        ctx = await start(settings, Metrics())
    except Exception as exc:
        return None, failed(exc)
    if isinstance(ctx, PoolingContext):
        try:
            device = ctx.engine.device
            return {"model": ctx.model_id, "task": ctx.task, "device": str(device), "max_model_len": ctx.max_context,
                    "dtype": str(next(ctx.engine.model.parameters()).dtype).removeprefix("torch."),
                    **({"pooling": ctx.pooling.describe(), "dimensions": ctx.dimensions} if ctx.task == "embed" else {})}, None
        finally:
            await asyncio.to_thread(close, ctx, settings.shutdown_grace_s)
    try:
        manager, pool = ctx.cache_manager, ctx.cache_manager.pool
        tiers = manager.tier_usage()
        return {
            "model": ctx.model_id,
            "device": str(pool.device),
            "dtype": str(pool.dtype).removeprefix("torch."),
            "max_model_len": ctx.max_context,
            "kv_cache": {
                "dtype": manager.config.kv_dtype,
                "budget_bytes": manager.store.budget_bytes,
                "capacity_tokens": manager.capacity_tokens(),
                "sequences_at_max_model_len": manager.capacity_tokens() // ctx.max_context,
                "recurrent_state": manager.recurrent_state(),
                "host_tier_bytes": tiers["host"][1],
                "disk_tier_bytes": tiers["disk"][1],
                "disk_tier_dir": str(settings.kv_disk_dir) if settings.kv_disk_dir is not None else None,
            },
            "engine": ctx.engine_paths,
            **({"ranks": ctx.ranks} if ctx.ranks is not None else {}),
            "max_running": settings.max_running,
            "max_batch_tokens": settings.max_batch_tokens,
        }, None
    finally:
        await asyncio.to_thread(close, ctx, settings.shutdown_grace_s)


def create_app(settings: Settings, loaded: LoadedModel | None = None) -> FastAPI:
    """The HTTP app serving what `start` builds; `loaded` lets tests share one loaded model."""
    return app.create_app(settings, app.Lifecycle(start, failed, close, response_store), loaded)
