"""The engine thread: admission queue, the step loop, cancellation and deadlines.

One thread owns the model; the asyncio event loop never waits on torch. Each step is three verbs
with a plain-data plan between them: `Scheduler.schedule()` picks the rows (every decoding
sequence, then prefill chunks under the token budget), `model_runner.run(plan)` does ONE forward
pass for all of them, and `_postprocess(plan, logits)` samples, appends, emits and finishes.
With speculative decoding the speculator completes the plan with drafts after scheduling, and
postprocess verifies them (server/engine/speculative.py). Outputs cross back to the event loop through
`loop.call_soon_threadsafe` onto the request's own asyncio queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cache_manager import kv
from cache_manager.manager import CacheManager, NoRoom
from cache_manager.prefix import ROPE_SWITCH
from grammars.matcher import start_masks
from server import memory
from server.engine import faults, families, lora, sampler, vision
from server.engine.lockstep import STATS_S, Figures, Leader, RankLost
from server.engine.model_runner import ModelRunner, StepOutput
from server.engine.sampling import take_rows
from server.engine.scheduler import Plan, ScheduledRow, Scheduler
from server.engine.sequence import GenerationRequest, RequestOutput, Sequence, Status, TokenInfo
from server.engine.speculative import NoSpeculation, SpeculativeConfig, Speculator

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Admission refused: the waiting queue is at its bound (the HTTP layer answers 429)."""


class EngineStopped(Exception):
    """The engine is draining or stopped and takes no new requests (503)."""


class SessionBusy(Exception):
    """The session already has a request in flight and the engine is set to refuse (409)."""


class StartupCheckFailed(RuntimeError):
    """The model failed its start-up forward pass (`ModelRunner.check`): it cannot serve."""


OOM_RELAX_STEPS = 64  # steps without an out-of-memory before the shrunk token budget doubles again
# The overlap's price: a row's forced tokens are known only once the token before them reaches
# the host, a step later than without it, so each costs that row a step; what it saves is the
# host's time per step (~0.1 of a step on a GPU: issue 47's figures). Steps wait for each other
# while more than `overlap_forced_max` of the rows taking a token had tokens forced after it
# (a moving average, `FORCED_WEIGHT` for each step): a schema of short keys, say.
FORCED_WEIGHT = 0.1
# How each step was launched (`Engine.steps`; /metrics: kvserve_engine_steps_total{launch}):
# "ahead", while the previous step was postprocessed (the overlap), or why it waited for it:
# "off": the overlap is off (`--no-overlap`, CPU's default, or a path that cannot undo a step);
# "host": a row's token was chosen on the host (penalties, logprobs, a draft to verify);
# "prefill": a prompt was being prefilled (in the step before, or waiting outside it);
# "forced": a grammar or a thinking budget forced tokens after a row's token (known only once it
# reached the host), or does so too often of late (`overlap_forced_max`);
# "admission": requests were waiting to be admitted, or calls to run between steps;
# "idle": no row went on from the step before (the first step after the engine idled);
# "fault": the step before failed or was retried in parts, or launching ahead raised.
STEP_LAUNCHES = ("ahead", "off", "host", "prefill", "forced", "admission", "idle", "fault")


@dataclass(slots=True)
class EngineConfig:
    max_context: int
    max_queue: int = 64
    max_running: int = 16
    max_batch_tokens: int = 512  # tokens one forward pass computes (decode rows + prefill chunks)
    reject_busy_sessions: bool = False  # False: a second request on a session waits its turn
    expire_every_s: float = 1.0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # with a proposer
    cpu_packed_weights: bool = True  # cpu_linear.pack_model's `packed`
    cuda_graphs: bool = True  # capture decode steps (CUDA only; --no-cuda-graphs)
    paged: bool | None = None  # ModelRunner's `paged`: the paged attention path (None: on CUDA)
    compile: str = "off"  # the decode forward compiled (--compile: auto, off, require; server/engine/compiled.py)
    overlap: bool | None = None  # launch a step before the previous one's tokens reach the host (None: on CUDA)
    overlap_forced_max: float = 0.1  # ... while at most this share of rows have tokens forced (FORCED_WEIGHT)
    exact: bool = False  # exact mode (--deterministic, server/engine/exact.py): outputs independent of batching
    encoder_cache_bytes: int = 256 * 2**20  # a vision-language model's features kept by picture (server/engine/vision.py)

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2")
        if self.max_queue < 1 or self.max_running < 1:
            raise ValueError("max_queue and max_running must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")


@dataclass(slots=True)
class Ahead:
    """A step launched before the previous one's tokens reached the host (the overlap,
    `Engine._launch_ahead`): its plan and output, and each row's length of `all_ids` once
    that previous token is appended (any other length: the row stopped, or tokens were forced
    after it, and it leaves the step: `Engine._settle`; a row whose tokens were all on the
    host: its length then)."""

    plan: Plan
    out: StepOutput
    lengths: list[int]


def _deliver(items: list[tuple["RequestHandle", RequestOutput]]) -> None:
    """On a request's event loop: the engine's outputs for it, in order."""
    for handle, output in items:
        handle._queue.put_nowait(output)


class RequestHandle:
    """The HTTP side of one request: iterate its outputs, or cancel it from any thread."""

    def __init__(self, seq: Sequence, engine: "Engine", loop: asyncio.AbstractEventLoop) -> None:
        self._seq = seq
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._admission: RequestOutput | None = None
        self.first_scheduled_at: float | None = None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def adapter(self):
        """The request's LoRA adapter (server/engine/lora.py), or None."""
        return self._seq.request.adapter

    def _put(self, output: RequestOutput) -> None:
        """Called on the engine thread: queued for the request's event loop with the rest of
        the step's outputs (`Engine._flush`)."""
        self._engine._outbox.append((self, output))

    def cancel(self) -> None:
        """Abort the sequence; the engine frees it within one step. Safe from any thread."""
        self._seq.cancelled = True
        self._engine.wake()

    @property
    def admission(self) -> RequestOutput | None:
        return self._admission

    async def admitted(self) -> RequestOutput:
        """Wait until the engine took the request: how much was reused, or why nothing was.

        The result is finished (with an error or abort) when the request ended before that.
        """
        if self._admission is None:
            self._admission = await self._queue.get()
        return self._admission

    async def __aiter__(self):
        """Outputs with text and tokens, the last one finished (the admission is not repeated)."""
        admission = await self.admitted()
        if admission.finished:
            yield admission
            return
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                return


class Engine:
    """Owns the model on one thread; `submit` from the event loop, outputs via handles."""

    def __init__(self, model, tokenizer, config: EngineConfig, cache_manager: CacheManager, metrics=None, proposer=None, adapters=None,
                 lockstep: Leader | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.cache_manager = cache_manager
        self.metrics = metrics
        self._last_expiry = 0.0
        self.eos_ids = end_of_turn_ids(model, tokenizer)
        # speculative decoding with a server/engine/speculative.py proposer, or a speculator doing nothing
        self.speculator = (
            NoSpeculation() if proposer is None else Speculator(proposer, self.eos_ids, config.speculative, metrics)
        )
        families.check_config(model)  # refuse what the config says the engine cannot model now, not on its thread
        if cache_manager.pool.states is not None:
            families.check_hybrid_modes(speculative=proposer is not None, exact=config.exact)
        self._rope_switch = cache_manager.pool.layout.rope_switch  # LongRoPE: `_cross_rope_switch`
        self.adapters = adapters  # LoRA adapters (server/engine/lora.py), or None
        self.runner = serving_runner(model, config, cache_manager.pool, metrics=metrics, adapters=adapters, speculative=proposer is not None,
                                     lockstep=lockstep)
        self.scheduler = Scheduler(config.max_batch_tokens, config.max_running, chunk_alone=self.runner.paged)
        self._waiting: collections.deque[tuple[Sequence, RequestHandle]] = collections.deque()
        self._running: list[tuple[Sequence, RequestHandle]] = []
        self._cond = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._prepared: Future[None] = Future()  # settled by the thread once the models are ready
        self._outbox: list[tuple[RequestHandle, RequestOutput]] = []  # engine thread only: `_flush`
        self._ahead: Ahead | None = None  # a step launched before the previous one was postprocessed
        self._forced = 0.0  # the share of rows with tokens forced after the one they took (FORCED_WEIGHT)
        self.steps = dict.fromkeys(STEP_LAUNCHES, 0)  # steps run, by how each was launched (read by /metrics)
        self._waits = "idle"  # why the next step scheduled waits for the one before (STEP_LAUNCHES)
        self._calls: list[tuple[Callable[[], object], Future]] = []  # run on the engine thread between steps (`call`)
        self._faults = faults.Faults.from_env()  # None unless a test switched faults on
        self._fault_hooks = self._faults.install(model) if self._faults is not None else []
        self._calm_steps = 0  # steps since the last out-of-memory (`_relax`)
        self.dead: str | None = None  # why the model cannot run any more (`_die`); None: alive
        self.trimmer = memory.Trimmer()  # freed heap back to the system once idle (`_maybe_expire`)
        self._figures, self._figures_at = Figures(), time.monotonic()  # this rank's forwards and memory (`_ranks`)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; returns once it has prepared the models (blocks: packing
        a model's weights on CPU takes seconds) and raises what preparing them raised."""
        self._thread.start()
        self._prepared.result()

    def stop(self) -> bool:
        """Abort everything still running and end the thread; False when it has not ended
        within 30 s (stuck in a step: its tensors must then stay)."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for hook in self._fault_hooks:
            hook.remove()
        return not self._thread.is_alive()

    def drain(self) -> None:
        """Refuse new requests; the ones already admitted run to completion."""
        with self._cond:
            self._accepting = False

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._running

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- admission -----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue a request; raises QueueFull at the bound, EngineStopped when draining."""
        seq = Sequence(request, self.tokenizer, self.runner.device)
        handle = RequestHandle(seq, self, loop)
        with self._cond:
            if self.dead is not None:
                raise EngineStopped("the model cannot run; the server is stopping (see its log)")
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"the queue holds {len(self._waiting)} requests, its maximum")
            key = request.session_key
            if key is not None and self.config.reject_busy_sessions and key in self._busy_keys():
                raise SessionBusy(f"session {key[1]!r} already has a request in flight")
            self._waiting.append((seq, handle))
            self._update_gauges()
            self._cond.notify_all()
        return handle

    def _busy_keys(self) -> set:
        return {k for seq, _ in self._running + list(self._waiting) if (k := seq.request.session_key) is not None}

    def _admit(self) -> None:
        """Move the waiting sequences the scheduler admits to running (their KV reserved), in
        arrival order; fail the ones it refuses. The cancelled and the expired leave the queue
        first."""
        with self._cond:
            candidates = list(self._waiting)
            running = [seq for seq, _ in self._running]
        now = time.monotonic()
        handles = dict(candidates)
        for seq, handle in candidates:
            adapter = seq.request.adapter
            gone = adapter is not None and self.adapters.get(adapter.name) is not adapter  # unloaded since it was submitted
            if seq.cancelled or seq.expired(now) or gone:
                self._dequeue(seq, handle)
                handle._put(seq.final_output("abort") if seq.cancelled else seq.final_output("error", error="adapter_unloaded" if gone else "timeout"))
                del handles[seq]
        admission = self.scheduler.admit(list(handles), running, self._reserve)
        for seq, error in admission.refused:
            self._dequeue(seq, handles[seq])
            handles[seq]._put(seq.final_output("error", error=error))
        for seq in admission.started:
            handle = handles[seq]
            with self._cond:
                self._waiting.remove((seq, handle))
                self._running.append((seq, handle))
                self._update_gauges()
            handle.first_scheduled_at = time.monotonic()
            handle._put(seq.admitted_output())
            self._continue(seq, handle)  # a forced prefix rides along with the prefill
        self._flush()

    def _reserve(self, seq: Sequence) -> bool:
        """The scheduler's `reserve`: the device slot of the sequence's LoRA adapter (may swap
        one in) and its cache from the cache manager (may crop, grow or evict); False when
        either does not fit now."""
        adapter = seq.request.adapter
        if adapter is not None:
            slot = self.adapters.acquire(adapter)
            if slot is None:  # every slot held by running sequences
                return False
            seq.adapter_slot = slot
        try:
            self._lease(seq)
        except NoRoom:
            self._release_adapter(seq)
            return False
        except Exception:  # a bug must fail this request, not the engine thread
            log.exception("admitting %s failed", seq.request_id)
            self._release_adapter(seq)
            raise
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_slot:
            self.adapters.release(seq.request.adapter)
            seq.adapter_slot = 0

    def _dequeue(self, seq: Sequence, handle: RequestHandle) -> None:
        with self._cond:
            self._waiting.remove((seq, handle))
            self._update_gauges()

    def _lease(self, seq: Sequence) -> None:
        """Get the sequence's cache from the cache manager (may crop, grow or evict)."""
        request = seq.request
        need = len(seq.prompt_ids) + seq.params.max_tokens
        lease = self.cache_manager.acquire(
            request.principal,
            request.session_id if request.use_session else None,
            seq.prompt_ids,
            need,
            private=not request.use_session,
        )
        seq.lease, seq.cache = lease, lease.cache  # its length: the tokens reused
        seq.cached_tokens = lease.n_reused
        seq.rope_long = self.cache_manager.pool.layout.rope_long(lease.n_reused)
        # NOTE: a restore is reported where misses are (X-Cache-Miss-Reason: restored_disk).
        seq.miss_reason = lease.miss_reason or (f"restored_{lease.restored}" if lease.restored else None)
        seq.status = Status.PREFILL

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.requests_waiting.set(len(self._waiting))
            self.metrics.requests_running.set(len(self._running))
            if self.adapters is not None:
                self.metrics.lora_requests_info(
                    self.adapters.max_loras,
                    running=sorted({a.name for seq, _ in self._running if (a := seq.request.adapter) is not None}),
                    waiting=sorted({a.name for seq, _ in self._waiting if (a := seq.request.adapter) is not None}),
                )

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        # NOTE: the models are prepared here, on the thread that runs them, so that it is the
        # only one with an OpenMP team (cpu_linear.pack_model).
        try:
            families.check(self.model)  # the probe (once per model): the server's load has run it already
            self.runner.prepare()  # kvserve's attention, packed CPU weights, CUDA graphs
            self.speculator.prepare()
            try:
                with torch.inference_mode():
                    self.runner.check()
            except Exception as exc:
                raise StartupCheckFailed(f"the model cannot run: its start-up forward pass failed ({type(exc).__name__}: {exc})") from exc
        except BaseException as exc:
            with self._cond:
                self._accepting = False
            self._prepared.set_exception(exc)
            return
        self._prepared.set_result(None)
        # NOTE: logits are inference tensors; the grammar mask and penalties modify them in
        # place, which torch allows only inside inference mode.
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not self._stop and not self._waiting and not self._running and not self._calls
                if idle:
                    # NOTE: wakes at least every expire_every_s, so that the expiry below and, with
                    # tensor parallel, the heartbeat (lockstep.HEARTBEAT_S) run while nothing else does
                    self._cond.wait(timeout=self.config.expire_every_s)
                if self._stop:
                    break
                calls, self._calls = ([], self._calls) if idle else (self._calls, [])
            # outside the lock: a session going to disk or, with tensor parallel, any collective
            # may take its time-out
            try:
                self._ranks(idle)
                self._maybe_expire()
                if idle:
                    continue
                for fn, future in calls:
                    self._call(fn, future)
                self._admit()
                self.step()
            except RankLost as exc:  # a step's, a heartbeat's, or a session's moving to or from a tier
                self._die(str(exc))
            except Exception as exc:  # noqa: BLE001 - see the note
                # NOTE: a row's faults are handled where they happen (`_execute`, `_choose`,
                # `_take`); what reaches here is not one: on CUDA an asynchronous device error
                # (an illegal address, a device-side assert) surfaces at the next wait, and the
                # device is of no more use. Without this the thread would end quietly, /health
                # stay 200 and every request wait for ever
                log.exception("a step failed outside any row's fault handling")
                self._die(f"a step failed outside any row's fault handling ({type(exc).__name__}: {exc})")
        for seq, handle in list(self._running):
            self._finish(seq, handle, "abort")
        for seq, handle in list(self._waiting):
            handle._put(seq.final_output("abort"))
        self._flush()
        with self._cond:
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(EngineStopped("the engine stopped"))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between two steps (what must not race a step: the
        LoRA adapters' device slots, sessions of its own); a Future of its result."""
        future: Future = Future()
        with self._cond:
            if self._stop or self.dead is not None:
                future.set_exception(EngineStopped("the engine is not running"))
                return future
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    def _call(self, fn: Callable[[], object], future: Future) -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
            future.set_exception(exc)
        self._flush()

    def unload_adapter(self, name: str) -> Future:
        """Unload LoRA adapter `name` on the engine thread: its waiting and running requests
        end with the error "adapter_unloaded", its sessions are dropped from every tier; a
        Future of (the Adapter, sessions dropped). KeyError when no adapter has that name."""

        def unload():
            adapter = self.adapters.get(name) if self.adapters is not None else None
            if adapter is None:
                raise KeyError(name)
            for seq, handle in list(self._running):
                if seq.request.adapter is adapter:
                    self._finish(seq, handle, "error", error="adapter_unloaded")
            for seq, handle in list(self._waiting):
                if seq.request.adapter is adapter:
                    self._dequeue(seq, handle)
                    handle._put(seq.final_output("error", error="adapter_unloaded"))
            self.adapters.remove(name)
            return adapter, self.cache_manager.drop_scope(lora.scope(adapter))

        return self.call(unload)

    def _flush(self) -> None:
        """Hand the outputs queued since the last flush to their event loops: one wake-up per
        loop and step, not one per output (at 64 rows a step's 64 wake-ups cost more host time
        than its sampling)."""
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, RequestOutput]]] = {}
        for handle, output in outbox:
            by_loop.setdefault(handle._loop, []).append((handle, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                for handle, _ in items:
                    handle._seq.cancelled = True

    def _maybe_expire(self) -> None:
        now = time.monotonic()
        if now - self._last_expiry >= self.config.expire_every_s:
            self._last_expiry = now
            self.cache_manager.expire()
            self.cache_manager.persist()  # to the disk tier, at most once per its interval
            # NOTE: glibc keeps a burst's freed heap (server/memory.py): handed back once nothing
            # runs, a few ms once per growth of RSS, never between a running request's steps
            if not self._running and not self._waiting and self.trimmer.due():
                self.trimmer.trim()

    def step(self) -> None:
        """One forward pass for every running sequence: schedule -> run -> postprocess; the
        outputs go to their event loops at the end."""
        try:
            self._step()
        finally:
            self._flush()

    def _step(self) -> None:
        t0 = time.perf_counter()
        now = time.monotonic()
        for seq, handle in list(self._running):
            if seq.cancelled:
                self._finish(seq, handle, "abort")
            elif seq.expired(now):
                self._finish(seq, handle, "error", error="timeout")
        if self._ahead is not None:
            self._land(t0)
            return
        if self._rope_switch is not None:
            for seq, _ in self._running:
                self._cross_rope_switch(seq)
        plan = self.scheduler.schedule([seq for seq, _ in self._running])
        if not plan.rows:
            return
        self.speculator.draft(plan, self.scheduler.max_batch_tokens)  # decode rows may carry drafts (under a shrunk budget too)
        prefill_tokens = sum(r.n_tokens for r in plan.rows if r.seq.status is Status.PREFILL)
        start_masks([r.seq.grammar for r in plan.rows if r.completes and r.seq.grammar is not None])
        launch = self._waits if self._overlaps else "off"
        self._waits = "fault"  # (unless its postprocess says why the next waits)
        self._execute(plan)
        self._checkpoint(plan)
        self._relax()
        if prefill_tokens >= max(64, plan.num_tokens // 2):  # a prefill step: its speed weighs restores
            self.cache_manager.observe_prefill(plan.num_tokens, time.perf_counter() - t0)
        self._observe(plan, t0, launch)

    def _observe(self, plan: Plan, t0: float, launch: str) -> None:
        self.steps[launch] += 1
        if self.metrics is not None:
            self.metrics.batch_rows.observe(len(plan.rows))
            self.metrics.batch_tokens.observe(plan.num_tokens)
            self.metrics.step_seconds.observe(time.perf_counter() - t0)

    # -- the overlap: a step launched before the previous one is postprocessed --

    def _after(self, plan: Plan, out: StepOutput, whole: bool = True) -> None:
        """Postprocess a step that ran; first, where the next step needs nothing from the host,
        launch it (`_launch_ahead`), so that the device computes it while the host detokenizes
        and emits this one. Not `whole`: the step is a part of one retried in parts (`_execute`),
        whose other parts are still to run."""
        chosen = self._chosen(plan, out)
        launched = self._launch_ahead(plan, chosen) if whole else "fault"
        if isinstance(launched, str):
            self._waits = launched
            self._postprocess(plan, out.logits, chosen)
            return
        ahead, tokens = launched
        try:
            # NOTE: on CUDA the step launched ahead is overwriting `out.logits` (every graph's
            # shared output): postprocess takes the chosen tokens and reads no logit
            self._postprocess(plan, out.logits, tokens())
        finally:  # a row postprocess did not reach has not appended its token: `_settle` undoes its step
            self._ahead = self._settle(ahead)
        if self._ahead is not None:  # the masks of its rows' next tokens, computed while the device runs it
            start_masks([row.seq.grammar for row in self._ahead.plan.rows if row.seq.grammar is not None])

    def _chosen(self, plan: Plan, out: StepOutput) -> torch.Tensor | None:
        """This step's tokens on the device (`sampler.chosen_on_device`), where every row
        completes (decode rows, tokens forced before the next, a prompt's last chunk) with no
        draft and its token is chosen there; None: postprocess chooses them. A draw that fails
        is left to postprocess, which finds the row that fails it."""
        if not all(row.completes and row.draft is None for row in plan.rows):
            return None
        try:
            return sampler.chosen_on_device([row.seq for row in plan.rows], out.logits, out.greedy)
        except Exception:  # noqa: BLE001 - `_choose` draws again, row by row where it must
            log.warning("choosing a step's tokens on the device failed: postprocess chooses them", exc_info=True)
            return None

    @property
    def _overlaps(self) -> bool:
        """Whether a step may be launched before the previous one is postprocessed (injected
        faults count the steps they fail, so they turn it off)."""
        return self.runner.overlap and self._faults is None

    def _launch_ahead(self, plan: Plan, chosen: torch.Tensor | None) -> tuple[Ahead, Callable[[], torch.Tensor]] | str:
        """The next step, launched now from this step's tokens on the device (`chosen`:
        `_chosen`; `ModelRunner.run_ahead`), with the wait for their copy to the host; or why
        it cannot be (STEP_LAUNCHES): the overlap is off, some row's token is chosen on the
        host (penalties, logprobs) or drafts, or the next step has work the host must do first:
        requests that may be admitted, calls to run, a prompt to prefill; or rows have had
        tokens forced too often of late (`FORCED_WEIGHT`).

        Its rows are those the scheduler would give the next step, in its order (running
        order): each row of `plan` with one token, the one this step chooses for it, and each
        decoding sequence outside `plan` with all its pending tokens, which are on the host
        (tokens a grammar or a thinking budget forced after the token a step launched ahead
        computed: `_settle`). A row whose next token cannot exist (max_tokens, its cache full)
        is left out; one that stops at this step's token (the end of its turn, a stop string)
        is found out only afterwards (`_settle`)."""
        if not self._overlaps:
            return "off"
        if chosen is None:
            return "host" if all(row.completes for row in plan.rows) else "prefill"
        if self._forced > self.config.overlap_forced_max:
            return "forced"
        with self._cond:
            admitting = self._waiting and len(self._running) < self.config.max_running
            if self._calls or admitting:
                return "admission"
            running = [seq for seq, _ in self._running]
        index = {id(row.seq): i for i, row in enumerate(plan.rows)}
        rows, pick = [], []
        for seq in running:
            i = index.get(id(seq))
            if i is None and seq.cancelled:
                continue  # (the next step finishes it first)
            if i is None and (seq.status is not Status.DECODE or seq.num_pending == 0):
                return "prefill"
            if i is None:  # its pending tokens: on the host
                rows.append(ScheduledRow(seq, seq.num_pending))
                pick.append(None)
            elif _continues(seq):
                rows.append(ScheduledRow(seq, 1))
                rows[-1].completes = True  # its pending token is the one this step chooses
                pick.append(i)
        if all(p is None for p in pick):
            return "idle"
        tokens = self.runner.to_host(chosen)  # before the next step overwrites a graph's output
        ahead = Plan(rows)
        try:
            launched = self.runner.run_ahead(ahead, chosen, pick)
        except Exception:  # noqa: BLE001 - the step runs again, scheduled as usual, with the fault handling
            log.warning("a step launched ahead failed: it runs again after this one", exc_info=True)
            self.runner.release_memory()
            return "fault"
        for row, p in zip(rows, pick):
            # until the step lands (`_land`): a row from the device computed one token more than waiting steps would have
            row.seq.ahead = int(p is not None)
        return Ahead(ahead, launched, [len(row.seq.all_ids) + (p is not None) for row, p in zip(rows, pick)]), tokens

    def _settle(self, ahead: Ahead) -> Ahead | None:
        """After the previous step's postprocess: the rows of the step launched ahead that
        went on with exactly the token it computed from. A row with tokens forced after that
        token (a grammar's keys, a thinking budget's end marker) keeps the token's KV, and
        leaves the step: what it computed from the token is not its next token. Its forced
        tokens go with the next step launched (`_launch_ahead`: from the host). The others
        lose what the step computed for them (`_undo_ahead`); a finished row did at `_finish`.
        When none is left, the step is not landed and the next waits: "forced" where a row
        went on with other tokens, "fault" where postprocess did not reach one, else "idle"."""
        keep, why = [], "idle"
        for i, (row, length) in enumerate(zip(ahead.plan.rows, ahead.lengths)):
            seq = row.seq
            if seq.status is Status.FINISHED:
                continue
            if len(seq.all_ids) == length and seq.num_pending == 0:
                keep.append(i)
            elif seq.ahead and len(seq.all_ids) > length and seq.n_computed == length:
                seq.ahead = 0  # its KV is the token taken, where a step that waited would have computed it with the forced ones
                why = "forced"
            else:
                _undo_ahead(seq)
                why = "forced" if len(seq.all_ids) > length else "fault"
        if not keep:
            self._waits = why
        return _only(ahead, keep)

    def _land(self, t0: float) -> None:
        """This step: the one launched ahead, postprocessed (and the next one launched from it)
        for its rows still running (a row cancelled, stopped or expired since was finished
        above, the token it computed cropped)."""
        ahead, self._ahead = self._ahead, None
        ahead = _only(ahead, [i for i, row in enumerate(ahead.plan.rows) if row.seq.status is not Status.FINISHED])
        if ahead is None:
            self._waits = "idle"
            return
        for row in ahead.plan.rows:
            row.seq.ahead = 0  # its KV is now what a step that waited would have computed
        self._after(ahead.plan, ahead.out)
        self._relax()
        self._observe(ahead.plan, t0, "ahead")

    def _checkpoint(self, plan: Plan) -> None:
        """A hybrid model: keep the recurrent state of each prompt computed up to one token
        short of its end (the scheduler paused it there: `Sequence.chunk_limit`), where a
        regenerated reply or an edit of the reply resumes (`kv.resume`)."""
        for row in plan.rows:
            seq = row.seq
            if seq.cache is not None and seq.cache.state is not None and seq.n_computed == len(seq.prompt_ids) - 1:
                kv.checkpoint(seq.cache)

    def _cross_rope_switch(self, seq: Sequence) -> None:
        """LongRoPE (server/engine/rope.py): a sequence whose keys were computed with the short
        factors and that has grown past the switch is recomputed from its first token with the
        long ones, as transformers' `generate` does. Side effects: crops its cache to nothing
        (the session keeps none of it: `release` drops the entry), reports no cached tokens and
        `rope_switch` as the miss reason, and schedules it as a prefill again."""
        if seq.rope_long or len(seq.all_ids) <= self._rope_switch:
            return
        seq.rope_long = True
        if seq.n_computed == 0:
            return
        kv.crop(seq.cache, 0)
        seq.cached_tokens = seq.lease.n_reused = 0
        seq.miss_reason = ROPE_SWITCH
        seq.status = Status.PREFILL
        if self.metrics is not None:  # kvserve_prefix_cache_misses{reason="rope_switch"}: one per recompute
            self.metrics.cache_misses.labels(ROPE_SWITCH).inc()

    def _postprocess(self, plan: Plan, logits: torch.Tensor, chosen: torch.Tensor | None = None) -> None:
        """Sample (or verify a draft), emit and finish the rows that completed (the forward
        pass moved their KV lengths). `chosen`: every row's token, chosen on the device
        (`_chosen`)."""
        completed, plain, drafted = [], [], []
        offset = 0
        for row in plan.rows:
            if row.completes:
                if row.draft is None:
                    completed.append(row.seq)
                    plain.append(offset)
                else:
                    drafted.append((row, logits[offset : offset + 1 + row.n_draft]))
                offset += 1 + row.n_draft
        handles = dict(self._running)
        for row, block in drafted:
            self._verify(row.seq, handles[row.seq], row.draft, block)
        if not completed:
            return
        if drafted:
            logits, chosen = take_rows(logits, plain), None
        forced = 0
        for seq, token in self._choose(completed, logits, chosen):
            if token is None:
                self._finish(seq, handles[seq], "error", error="internal")
                continue
            seq.status = Status.DECODE
            if seq.grammar is not None and self.metrics is not None:
                self.metrics.grammar_mask_seconds.observe(seq.grammar.last_mask_s)
            length = len(seq.all_ids)
            try:
                self._take(seq, handles[seq], token)
            except Exception:
                log.exception("request %s failed", seq.request_id)
                self._finish(seq, handles[seq], "error", error="internal")
            forced += len(seq.all_ids) > length + 1
        self._forced += FORCED_WEIGHT * (forced / len(completed) - self._forced)

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor, chosen: torch.Tensor | None = None) -> list[tuple[Sequence, TokenInfo | None]]:
        """`sampler.choose` for the rows: None for a row that drew from no distribution; when
        it raises, each row is chosen alone and only the ones that raise again get None.

        NOTE: a row retried alone sees its logits as the failed call left them: a constraint
        mask added twice allows the same tokens, but penalties applied before the failure
        apply twice (no retry is exact for a row with penalties); a seeded row that drew
        before the failure draws again."""
        try:
            if self._faults is not None:
                self._faults.before_sampling(seqs)
            tokens = sampler.choose(seqs, logits, chosen)
        except Exception:
            if len(seqs) == 1:
                log.exception("choosing the token of %s failed", seqs[0].request_id)
                self._fault("sampling")
                return [(seqs[0], None)]
            log.warning("choosing the tokens of %d rows failed: choosing each alone", len(seqs), exc_info=True)
            return [pair for i, seq in enumerate(seqs) for pair in self._choose([seq], logits[i : i + 1], None if chosen is None else chosen[i : i + 1])]
        for seq, token in zip(seqs, tokens):
            if token is None:
                log.error("request %s drew its token from no distribution (NaN or inf in its logits)", seq.request_id)
                self._fault("sampling")
        return list(zip(seqs, tokens))

    def _verify(self, seq: Sequence, handle: RequestHandle, draft, logits: torch.Tensor) -> None:
        """Take a drafted row's tokens as `_take` would have taken them one step at a time: the
        accepted drafted tokens (their KV is already computed: the rejected ones' is cropped),
        then the token chosen at the first rejected position, sent as one output."""
        try:
            tokens, accepted = self.speculator.verify(seq, draft, logits)
            kv.crop(seq.cache, kv.length(seq.cache) - (len(draft.tokens) - accepted))
            grammar = seq.grammar  # the speculator drafts no row whose grammar waits for an answer
            if grammar is not None and self.metrics is not None:
                self.metrics.grammar_mask_seconds.observe(grammar.last_mask_s)
            drafted, final = tokens[:accepted], tokens[accepted:]
            if grammar is None and final and final[0].token_id not in self.eos_ids:
                if not self._emit(seq, handle, tokens):
                    self._continue(seq, handle)
                return
            if grammar is not None and not grammar.accept_tokens([t.token_id for t in drafted]):
                raise RuntimeError(f"the grammar refused a verified draft: {grammar.error}")
            if drafted and self._emit(seq, handle, drafted):
                return
            if final:
                self._take(seq, handle, final[0])
            else:  # the draft ended where the grammar completes, or forces the next tokens
                self._continue(seq, handle)
        except Exception:
            log.exception("request %s failed", seq.request_id)
            self._finish(seq, handle, "error", error="internal")

    # -- faults -------------------------------------------------------------------------------

    def _execute(self, plan: Plan) -> None:
        """Run the plan's forward pass and postprocess it. When the pass raises, the step is
        split until the row that caused it is alone: that row fails ("internal"), the others
        run on in smaller passes, their tokens what the whole step would have given them (up
        to the rounding of another batch shape: the near-tie rule). Out of memory shrinks the
        step instead (`_shrink`): fewer rows a pass, then a smaller prefill chunk; only a row
        that cannot run even alone with one token fails ("out_of_memory"). A row that failed
        alone while nothing of the step had run yet is checked against a known-good pass
        (`_alive`): when that fails too the model itself is broken, and every row fails as
        the engine dies."""
        parts = [plan]
        ran, checked, failed = False, False, []
        while parts:
            part = parts.pop(0)
            try:
                t_run = time.perf_counter()
                if self._faults is not None:
                    self._faults.before_forward(part)
                out = self.runner.run(part)
                self._figures.ran(time.perf_counter() - t_run)
                if self.speculator.timed:  # the step's cost, not its launch's: a sync
                    self.runner.synchronize()
                    self.speculator.observe(part.num_tokens, time.perf_counter() - t_run)
            except Exception as exc:
                if self.runner.lockstep is not None:
                    # NOTE: with tensor parallel a forward that failed on one rank may have left
                    # the others inside a collective: no later step could be trusted to meet
                    # theirs, so a failed step (out of memory too) ends the engine
                    self._die(self.runner.lockstep.lost(exc) or f"a step failed on rank 0 ({type(exc).__name__}: {exc}); "
                              "the tensor-parallel ranks cannot be kept in step after it")
                    return
                if isinstance(exc, torch.OutOfMemoryError):
                    self.runner.release_memory()
                    smaller = self._shrink(part)
                    if smaller:
                        parts[:0] = smaller
                        continue
                    row = part.rows[0]
                    log.warning("out of memory: %s cannot run even alone with one token", row.seq.request_id)
                    self._fault("oom_row")
                    self._finish(row.seq, self._handle(row.seq), "error", error="out_of_memory")
                    continue
                if len(part.rows) > 1:
                    log.warning("a step of %d rows failed: retrying it in halves to find the row that fails", len(part.rows), exc_info=True)
                    parts[:0] = _halves(part)
                    continue
                row = part.rows[0]
                log.exception("the forward pass of %s failed (alone)", row.seq.request_id)
                if not (ran or checked):
                    checked = True
                    if not self._alive():
                        return
                self._fault("forward")
                failed.append(row.seq)
            else:
                ran = True
                self._after(part, out, whole=part is plan)
        for seq in failed:
            self._finish(seq, self._handle(seq), "error", error="internal")

    def _shrink(self, part: Plan) -> list[Plan]:
        """A part that ran out of memory, as smaller parts to run in its place (in order): its
        rows in two halves; a row alone without its draft, then with half its tokens (the rest
        of a prefill waits for the next steps, its KV so far kept). Empty when it cannot shrink.
        Later steps prefill under half the token budget that failed (`_relax` restores it)."""
        self._fault("oom_shrink")
        self._calm_steps = 0
        self.scheduler.max_batch_tokens = max(1, min(self.scheduler.max_batch_tokens, part.num_tokens // 2))
        log.warning("out of memory in a step of %d rows and %d tokens: shrinking it (token budget now %d)",
                    len(part.rows), part.num_tokens, self.scheduler.max_batch_tokens)
        if len(part.rows) > 1:
            return _halves(part)
        row = part.rows[0]
        if row.draft is not None:
            self.speculator.discard(row)
            return [Plan([ScheduledRow(row.seq, row.n_tokens)])]
        if row.n_tokens > 1 and (half := row.seq.fit(row.n_tokens // 2)) < row.n_tokens:
            return [Plan([ScheduledRow(row.seq, half)])]
        return []

    def _relax(self) -> None:
        """After `OOM_RELAX_STEPS` steps without running out of memory, double a shrunk token
        budget again (up to the configured one)."""
        if self.scheduler.max_batch_tokens >= self.config.max_batch_tokens:
            return
        self._calm_steps += 1
        if self._calm_steps >= OOM_RELAX_STEPS:
            self._calm_steps = 0
            self.scheduler.max_batch_tokens = min(self.config.max_batch_tokens, 2 * self.scheduler.max_batch_tokens)

    def _alive(self) -> bool:
        """After a row failed alone: a known-good pass on a scratch sequence (the start-up
        check). If it fails too the fault is the model's, not the row's: the engine dies
        (`_die`) and this is False. Inconclusive (True) when the pool has no block for it or
        the device no memory."""
        try:
            self.runner.check()
        except (kv.NoBlocks, torch.OutOfMemoryError) as exc:
            log.warning("the check after a failed step could not run (%s): assuming the model still runs", type(exc).__name__)
        except Exception as exc:
            self._die(f"a known-good forward pass fails too ({type(exc).__name__}: {exc})")
            return False
        return True

    def _ranks(self, idle: bool) -> None:
        """Between steps: with tensor parallel the heartbeat when idle (server/engine/lockstep.py);
        every STATS_S each rank's figures (one process: its own, as rank 0) into the metrics.
        RankLost when a rank is gone."""
        lockstep = self.runner.lockstep
        if lockstep is not None and idle:
            lockstep.heartbeat()
        if time.monotonic() - self._figures_at < STATS_S:
            return
        self._figures_at = time.monotonic()
        mine = self._figures.take()
        every = lockstep.stats(mine) if lockstep is not None else [mine]
        if self.metrics is not None:
            for rank, figures in enumerate(every):
                if figures["step_seconds"] is not None:
                    self.metrics.rank_step_seconds.labels(str(rank)).set(figures["step_seconds"])
                self.metrics.rank_memory_bytes.labels(str(rank), "in_use").set(figures["in_use"])

    def _die(self, reason: str) -> None:
        """The model cannot run: fail every request with "engine_dead", take no more, end the
        loop. The server sees `dead`, turns /health and /ready 503 and exits non-zero, so the
        orchestrator restarts it."""
        log.critical("the engine is dead: %s", reason)
        self._fault("engine_dead")
        with self._cond:
            self.dead = reason
            self._accepting = False
            self._stop = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq, handle in list(self._running):
            self._finish(seq, handle, "error", error="engine_dead")
        for seq, handle in waiting:
            handle._put(seq.final_output("error", error="engine_dead"))
        self._update_gauges()

    def _fault(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.engine_faults.labels(kind).inc()

    def _handle(self, seq: Sequence) -> RequestHandle:
        return next(handle for s, handle in self._running if s is seq)

    def _take(self, seq: Sequence, handle: RequestHandle, token: TokenInfo) -> None:
        """Append the sampled token (and what is forced after it), or finish."""
        grammar = seq.grammar
        if token.token_id in self.eos_ids:
            if grammar is not None and not grammar.is_accepting:
                # a matcher in error allows only end-of-turn: never report that as a valid "stop"
                log.warning("grammar dead end in %s: %s", seq.request_id, grammar.error)
                self._finish(seq, handle, "error", error="grammar")
                return
            self._finish(seq, handle, "stop")  # the mask allows end-of-turn only where it accepts
            return
        if grammar is not None and not grammar.accept(token.token_id):
            # NOTE: llguidance's mask can allow a token its parser then refuses, past a byte no
            # token holds (a Lark or regex literal with such a byte): a dead end of the grammar.
            log.warning("grammar refused a masked token in %s: %s", seq.request_id, grammar.error)
            self._finish(seq, handle, "error", error="grammar")
            return
        if not self._emit(seq, handle, [token]):
            self._continue(seq, handle)

    def _continue(self, seq: Sequence, handle: RequestHandle) -> None:
        """Append what is forced before the next sampled token, computed by the next forward
        pass: a thinking model's start marker (a grammar request whose prompt left the
        reasoning to the model) or end marker (its thinking budget spent), then the tokens its
        grammar forces; or finish a complete grammar.

        NOTE: when logprobs are asked for, forced tokens wait for a forward pass of their own so
        the model's logprob is reported: a grammar's are sampled under a one-token mask, the
        markers are taken at their position (`sampler.forced_marker`).
        """
        reasoning = seq.reasoning
        while reasoning is not None and not seq.params.logprobs and (forced := reasoning.opening() or reasoning.forced()):
            room = seq.params.max_tokens - len(seq.generated)  # > 0: `_emit` finishes at max_tokens
            if self._emit(seq, handle, [TokenInfo(t) for t in forced[:room]]):
                return
        grammar = seq.grammar
        if grammar is None:
            return
        if grammar.is_terminated:
            self._finish(seq, handle, "stop")  # complete: no further forward pass
            return
        if seq.params.logprobs:
            return
        room = seq.params.max_tokens - len(seq.generated)
        forced = grammar.fast_forward_tokens()[:room]
        if forced and grammar.accept_tokens(forced):
            if not self._emit(seq, handle, [TokenInfo(t) for t in forced]) and grammar.is_terminated:
                self._finish(seq, handle, "stop")

    def _emit(self, seq: Sequence, handle: RequestHandle, tokens: list[TokenInfo]) -> bool:
        """Append sampled or forced tokens, send what they add to the output; True when that
        finished the request (a stop string or the watcher, max_tokens, or a full cache)."""
        output = RequestOutput()
        for token in tokens:
            added = seq.append(token)
            _extend(output, added.output)
            if added.stopped:
                handle._put(output)
                self._finish(seq, handle, "stop")
                return True
        handle._put(output)
        if seq.at_length():
            self._finish(seq, handle, "length")
            return True
        return False

    def _finish(
        self, seq: Sequence, handle: RequestHandle, reason: str, error: str | None = None
    ) -> None:
        """Commit (or roll back) the sequence's KV, then send the final output."""
        seq.status = Status.FINISHED
        self.speculator.finish(seq, committed=reason in ("stop", "length"))
        _undo_ahead(seq)  # a step launched ahead computed past this end: the session never holds it
        if seq.lease is not None:
            try:
                if reason in ("stop", "length"):
                    # NOTE: a verified draft may have computed past a stop string: the cache
                    # keeps the tokens it commits.
                    n = min(seq.n_computed, len(seq.all_ids))
                    kv.crop(seq.cache, n)
                    self.cache_manager.commit(seq.lease, seq.all_ids[:n])
                else:
                    self.cache_manager.release(seq.lease)
            except Exception:
                log.exception("cache bookkeeping failed for %s", seq.request_id)
            seq.lease = None
        seq.cache = None
        self._release_adapter(seq)
        rest = seq.flush() if reason in ("stop", "length") else None
        with self._cond:
            if (seq, handle) in self._running:
                self._running.remove((seq, handle))
                if not self._running:
                    self._waits = "idle"  # the next step has no step before it to wait for
            self._update_gauges()
        # NOTE: the gauges are updated before the client hears the end, so a client that reads
        # /metrics right after its response sees its request gone.
        handle._put(seq.final_output(reason, error=error, rest=rest))


def _continues(seq: Sequence) -> bool:
    """Whether the sequence can take one more token after the one being sampled for it (not
    at max_tokens, room in its cache): a step launched ahead may compute it."""
    return not seq.cancelled and seq.cache is not None and not seq.at_length(1)


def _undo_ahead(seq: Sequence) -> None:
    """Drop the KV a step launched ahead computed for the sequence (`Sequence.ahead`)."""
    if seq.ahead and seq.cache is not None:
        kv.crop(seq.cache, seq.n_computed - seq.ahead)
    seq.ahead = 0


def _only(ahead: Ahead, keep: list[int]) -> Ahead | None:
    """`ahead` with the rows `keep` (indices, in order) alone; None for none."""
    if not keep:
        return None
    if len(keep) == len(ahead.plan.rows):
        return ahead
    return Ahead(Plan([ahead.plan.rows[i] for i in keep]), ahead.out.rows(keep), [ahead.lengths[i] for i in keep])


def _halves(plan: Plan) -> list[Plan]:
    """The plan's rows as two plans, in order (a step retried smaller: `Engine._execute`)."""
    half = len(plan.rows) // 2
    return [Plan(plan.rows[:half]), Plan(plan.rows[half:])]


def _extend(output: RequestOutput, more: RequestOutput) -> None:
    """Append `more` (text, tokens, reasoning) to `output`, in generation order: reasoning
    comes before the answer, so `more`'s reasoning tokens follow `output`'s."""
    output.text += more.text
    output.reasoning += more.reasoning
    output.n_reasoning += more.n_reasoning
    output.tokens += more.tokens


def serving_runner(model, config: EngineConfig, pool: kv.Pool, *, metrics=None, adapters=None, speculative: bool = False,
                   lockstep: Leader | None = None) -> ModelRunner:
    """The runner an engine serves with (a tensor-parallel follower builds its own alike,
    server/startup.py `follow`: both must run the same forwards)."""
    return ModelRunner(
        model,
        pool,
        max_context=config.max_context,
        packed=config.cpu_packed_weights,
        cuda_graphs=config.cuda_graphs,
        max_rows=config.max_running,
        paged=config.paged,
        compile=config.compile,
        overlap=False if speculative else config.overlap,  # speculation drafts from the host's tokens each step
        exact=config.exact,
        adapters=adapters,
        merge=True,
        encoder=vision.Encoder(model, config.encoder_cache_bytes, metrics) if vision.sees_images(model, config.exact) else None,
        lockstep=lockstep,
    )


def end_of_turn_ids(model, tokenizer) -> frozenset[int]:
    """End-of-turn ids: the generation config's (int or list) plus the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
