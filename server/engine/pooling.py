"""The pooling engine: embeddings and relevance scores from one forward pass per batch, no KV kept.

One thread owns the model. Requests queue their inputs (`submit`); the thread takes what is
queued, every request's inputs together, sorts them by length into right-padded batches of at
most `max_batch_tokens` padded tokens (an input longer than that runs alone), runs one forward
pass per batch through the head chosen at start-up, and hands each request its rows once all of
them are done. The asyncio event loop never waits on torch.

Shapes: ids, mask, types [B, T] (right-padded); lengths [B]; hidden [B, T, H];
an embedding head returns [B, D], a score head [B].
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from server.engine.core import EngineStopped, QueueFull
from server.engine.pooling_spec import PoolingSpec

log = logging.getLogger(__name__)

MAX_ROWS = 256  # rows of one forward pass, however short they are
MAX_ROUND_ROWS = 8 * MAX_ROWS  # rows sorted together into one round of batches


@dataclass(frozen=True, slots=True)
class PoolingInput:
    """One sequence to pool: its token ids, and its token types where the model takes them
    (a cross-encoder's query/document segments)."""

    ids: list[int]
    token_types: list[int] | None = None


@dataclass(slots=True)
class Batch:
    """One forward pass's inputs, on the model's device."""

    ids: torch.Tensor  # [B, T] right-padded with the pad id
    mask: torch.Tensor  # [B, T] 1 on real tokens
    types: torch.Tensor | None  # [B, T] token type ids, or None
    lengths: torch.Tensor  # [B] real tokens per row

    def model_inputs(self) -> dict:
        extra = {} if self.types is None else {"token_type_ids": self.types}
        return {"input_ids": self.ids, "attention_mask": self.mask, **extra}


class Head(Protocol):
    """What one forward pass computes: `head(model, batch)` -> [B, ...] on the device."""

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor: ...


def _pool(mode: str, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """One sentence-transformers pooling mode over right-padded rows: [B, T, H] -> [B, H]."""
    mask = batch.mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.lengths - 1]
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    if mode == "weightedmean":
        weights = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1) * mask
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    total, count = (hidden * mask).sum(dim=1), mask.sum(dim=1).clamp(min=1e-9)
    return total / count if mode == "mean" else total / count.sqrt()  # mean, mean_sqrt_len_tokens


class EmbedHead:
    """Hidden states -> the pooled vector (the spec's modes concatenated), L2-normalized when
    the model's configuration says so. Pooling runs in float32 whatever the model's dtype."""

    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        hidden = model(**batch.model_inputs(), use_cache=False).last_hidden_state.float()
        pooled = torch.cat([_pool(mode, hidden, batch) for mode in self.spec.modes], dim=-1)
        return F.normalize(pooled, p=2, dim=-1) if self.spec.normalize else pooled


class ClassifierHead:
    """A sequence-classification model's single logit through its activation (sentence-transformers'
    CrossEncoder.predict: sigmoid unless the checkpoint names another)."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.activation = activation

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return self.activation(model(**batch.model_inputs()).logits.float()[:, 0])


class YesNoHead:
    """A decoder reranker of Qwen3-Reranker's kind: P("yes") of the softmax over the "yes" and
    "no" logits of the token after each row's last one.

    NOTE: the output projection runs on each row's last position only (not [B, T, vocab])."""

    def __init__(self, yes_id: int, no_id: int) -> None:
        self.yes_id, self.no_id = yes_id, no_id

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        hidden = model.get_decoder()(**batch.model_inputs(), use_cache=False).last_hidden_state  # [B, T, H]
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.lengths - 1]  # [B, H]
        logits = model.get_output_embeddings()(last)[:, [self.no_id, self.yes_id]].float()  # [B, 2]: no, yes
        return torch.log_softmax(logits, dim=-1)[:, 1].exp()


class _Job:
    """One request's inputs and the rows computed so far; its future is resolved on its loop."""

    __slots__ = ("inputs", "results", "left", "future", "loop", "failed")

    def __init__(self, inputs: list[PoolingInput], loop: asyncio.AbstractEventLoop) -> None:
        self.inputs, self.loop = inputs, loop
        self.results: list[torch.Tensor | None] = [None] * len(inputs)
        self.left = len(inputs)
        self.future: asyncio.Future = loop.create_future()
        self.failed = False
        self.future.add_done_callback(self._dropped)

    def _dropped(self, future: asyncio.Future) -> None:
        """A future cancelled by its waiter (deadline, client gone): its rows not yet run are skipped."""
        if future.cancelled():
            self.failed = True

    def done(self, row: int, value: torch.Tensor) -> None:
        self.results[row] = value
        self.left -= 1
        if self.left == 0:
            self._settle(self.future.set_result, self.results)

    def fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self._settle(self.future.set_exception, exc)

    def _settle(self, how, value) -> None:
        def settle():
            if not self.future.done():
                how(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class Pooler:
    """The pooling engine thread over `model` (already on its device, in eval mode) and `head`.
    Its lifecycle verbs are the generation engine's (`start`, `drain`, `idle`, `stop`, `dead`),
    so the app treats both alike."""

    def __init__(self, model: torch.nn.Module, head: Head, *, pad_id: int, max_batch_tokens: int, max_queue: int) -> None:
        self.model, self.head, self.pad_id = model, head, pad_id
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.device = next(model.parameters()).device
        self.dead: str | None = None  # why the thread stopped serving (None while it serves)
        self._pending: collections.deque[tuple[_Job, int]] = collections.deque()
        self._jobs = 0  # jobs submitted and not yet finished
        self._cond = threading.Condition()
        self._draining = self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvserve-pooler", daemon=True)
        self._thread.start()

    def submit(self, inputs: list[PoolingInput], loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Queue a request's inputs; the future resolves to one CPU float32 tensor per input (in
        order), or raises the forward pass's error; cancelling it drops the rows not yet run.
        QueueFull beyond `max_queue` requests waiting, EngineStopped while draining or stopped."""
        job = _Job(inputs, loop)
        with self._cond:
            if self._draining or self._stopping or self.dead is not None:
                raise EngineStopped()
            if self._jobs >= self.max_queue:
                raise QueueFull(f"{self._jobs} requests are waiting (--max-queue {self.max_queue})")
            self._jobs += 1
            self._pending.extend((job, row) for row in range(len(inputs)))
            self._cond.notify()
        job.future.add_done_callback(self._finished)
        return job.future

    def _finished(self, _future) -> None:
        with self._cond:
            self._jobs -= 1

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._jobs == 0

    def drain(self) -> None:
        """Refuse new requests; queued ones still run."""
        with self._cond:
            self._draining = True

    def stop(self) -> None:
        """Stop the thread (after the round of batches it is running); queued requests fail with EngineStopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            for job, _ in self._pending:
                job.fail(EngineStopped())
            self._pending.clear()

    def _take(self) -> list[list[tuple[_Job, int]]]:
        """The next round: every queued row (at most `MAX_ROUND_ROWS`, oldest first), sorted by
        length and cut into batches of at most `max_batch_tokens` padded tokens (a longer row
        alone), so that rows of like lengths pad together, as sentence-transformers sorts its
        inputs. Rows queued later wait for the next round."""
        rows: list[tuple[_Job, int]] = []
        while self._pending and len(rows) < MAX_ROUND_ROWS:
            job, row = self._pending.popleft()
            if not job.failed:
                rows.append((job, row))
        rows.sort(key=lambda r: len(r[0].inputs[r[1]].ids))
        batches: list[list[tuple[_Job, int]]] = []
        for job, row in rows:  # ascending: the row joining a batch is its longest
            n = len(job.inputs[row].ids)
            if not batches or len(batches[-1]) == MAX_ROWS or (len(batches[-1]) + 1) * n > self.max_batch_tokens:
                batches.append([])
            batches[-1].append((job, row))
        return batches

    def _collate(self, rows: list[tuple[_Job, int]]) -> Batch:
        inputs = [job.inputs[row] for job, row in rows]
        width = max(len(x.ids) for x in inputs)
        ids = [x.ids + [self.pad_id] * (width - len(x.ids)) for x in inputs]
        mask = [[1] * len(x.ids) + [0] * (width - len(x.ids)) for x in inputs]
        typed = any(x.token_types is not None for x in inputs)
        types = [(x.token_types or [0] * len(x.ids)) + [0] * (width - len(x.ids)) for x in inputs] if typed else None
        to = dict(device=self.device, dtype=torch.long)
        return Batch(
            ids=torch.tensor(ids, **to), mask=torch.tensor(mask, **to),
            types=torch.tensor(types, **to) if types is not None else None,
            lengths=torch.tensor([len(x.ids) for x in inputs], **to),
        )

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    batches = self._take()
                for rows in batches:
                    self._run(rows)
        except BaseException as exc:  # noqa: BLE001 - the thread must say why it stopped
            log.exception("the pooling engine stopped")
            self.dead = f"{type(exc).__name__}: {exc}"

    def _run(self, rows: list[tuple[_Job, int]]) -> None:
        """One forward pass; a failure fails the requests of its rows (the others run on)."""
        try:
            with torch.inference_mode():
                out = self.head(self.model, self._collate(rows)).float().cpu()  # one device-to-host copy
        except Exception as exc:  # noqa: BLE001 - a failing batch fails its requests alone
            log.exception("a pooling forward pass of %d rows failed", len(rows))
            for job, _ in rows:
                job.fail(exc)
            return
        for (job, row), value in zip(rows, out):
            if not job.failed:
                job.done(row, value)
