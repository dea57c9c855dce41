"""The engine thread: admission queue, scheduler loop, cancellation and deadlines.

One thread owns the model; the asyncio event loop never waits on torch. Each scheduler step
advances every running sequence by one unit of work (a prefill chunk or one decoded token), so
no request waits for another to finish. Outputs cross back to the event loop through
`loop.call_soon_threadsafe` onto the request's own asyncio queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from cache_manager import kv
from server import model_runner
from server.sequence import GenerationRequest, RequestOutput, Sequence, Status

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Admission refused: the waiting queue is at its bound (the HTTP layer answers 429)."""


class EngineStopped(Exception):
    """The engine is draining or stopped and takes no new requests (503)."""


@dataclass(slots=True)
class EngineConfig:
    max_context: int
    max_queue: int = 64
    max_running: int = 16
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2")
        if self.max_queue < 1 or self.max_running < 1:
            raise ValueError("max_queue and max_running must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")


class RequestHandle:
    """The HTTP side of one request: iterate its outputs, or cancel it from any thread."""

    def __init__(self, seq: Sequence, engine: "Engine", loop: asyncio.AbstractEventLoop) -> None:
        self._seq = seq
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.first_scheduled_at: float | None = None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    def _put(self, output: RequestOutput) -> None:
        """Called on the engine thread; hops onto the request's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self._seq.cancelled = True

    def cancel(self) -> None:
        """Abort the sequence; the engine frees it within one step. Safe from any thread."""
        self._seq.cancelled = True
        self._engine.wake()

    async def __aiter__(self):
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                return


class Engine:
    """Owns the model on one thread; `submit` from the event loop, outputs via handles."""

    def __init__(self, model, tokenizer, config: EngineConfig, metrics=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self._eos_ids = _eos_ids(model, tokenizer)
        self._waiting: collections.deque[tuple[Sequence, RequestHandle]] = collections.deque()
        self._running: list[tuple[Sequence, RequestHandle]] = []
        self._cond = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort everything still running and end the thread."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

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
        seq = Sequence(request, self.tokenizer)
        handle = RequestHandle(seq, self, loop)
        with self._cond:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"the queue holds {len(self._waiting)} requests, its maximum")
            self._waiting.append((seq, handle))
            self._update_gauges()
            self._cond.notify_all()
        return handle

    def _admit(self) -> None:
        with self._cond:
            while self._waiting and len(self._running) < self.config.max_running:
                seq, handle = self._waiting.popleft()
                if seq.cancelled:
                    handle._put(seq.final_output("abort"))
                    continue
                self._running.append((seq, handle))
                handle.first_scheduled_at = time.monotonic()
            self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.requests_waiting.set(len(self._waiting))
            self.metrics.requests_running.set(len(self._running))

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stop:
                    break
            self._admit()
            self.step()
        for seq, handle in self._running + list(self._waiting):
            self._finish(seq, handle, "abort")

    def step(self) -> None:
        """Advance every running sequence by one prefill chunk or one token."""
        now = time.monotonic()
        for seq, handle in list(self._running):
            if seq.cancelled:
                self._finish(seq, handle, "abort")
            elif seq.expired(now):
                self._finish(seq, handle, "error", error="timeout")
            else:
                try:
                    self._advance(seq, handle)
                except torch.OutOfMemoryError:
                    log.warning("out of memory in request %s", seq.request_id)
                    self._finish(seq, handle, "error", error="out_of_memory")
                except Exception:
                    log.exception("request %s failed", seq.request_id)
                    self._finish(seq, handle, "error", error="internal")

    def _advance(self, seq: Sequence, handle: RequestHandle) -> None:
        if seq.cache is None:
            need = len(seq.prompt_ids) + seq.params.max_tokens
            capacity = kv.capacity_bucket(need, self.config.max_context)
            seq.cache = kv.allocate(self.model.config, capacity, self.model.device, self.model.dtype)
            seq.status = Status.PREFILL
        logits = model_runner.advance(self.model, seq, self.config.prefill_chunk)
        if logits is None:
            return  # still prefilling
        seq.status = Status.DECODE
        token = model_runner.choose(seq, logits)
        if token.token_id in self._eos_ids:
            self._finish(seq, handle, "stop")
            return
        seq.generated.append(token.token_id)
        delta = seq.text.push(token.token_id)
        if delta.stopped:
            handle._put(RequestOutput(text=delta.text, tokens=[token]))
            self._finish(seq, handle, "stop")
            return
        handle._put(RequestOutput(text=delta.text, tokens=[token]))
        if len(seq.generated) >= seq.params.max_tokens or seq.n_computed >= kv.capacity(seq.cache):
            self._finish(seq, handle, "length")

    def _finish(
        self, seq: Sequence, handle: RequestHandle, reason: str, error: str | None = None
    ) -> None:
        """Send the final output and free the sequence's KV."""
        seq.status = Status.FINISHED
        seq.cache = None
        text = seq.text.flush() if reason in ("stop", "length") else ""
        with self._cond:
            if (seq, handle) in self._running:
                self._running.remove((seq, handle))
            self._update_gauges()
        # NOTE: the gauges are updated before the client hears the end, so a client that reads
        # /metrics right after its response sees its request gone.
        handle._put(seq.final_output(reason, error=error, text=text))


def _eos_ids(model, tokenizer) -> frozenset[int]:
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
