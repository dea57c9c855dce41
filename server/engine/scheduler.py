"""Which waiting sequences start (their KV reserved), and which running sequences one engine
step computes, with how many tokens each.

Admission (`admit`): waiting sequences start in arrival order while fewer than `max_running`
run. Starting one reserves its KV in the pool (the cache manager: reuse, crop, grow, evict idle
sessions), for its prompt and its `max_tokens`, so a running sequence never waits for memory:
a sequence whose session already runs stays waiting without blocking the ones behind it; one
whose KV does not fit now waits for running ones to free memory and blocks the queue behind it
(it is not starved); with nothing running it can never fit and is refused.

One step is ONE forward pass over a batch built under a token budget (`max_batch_tokens`):

1. every decoding sequence is a row with all its pending tokens (one sampled token, or the
   tokens a grammar forced, which go through in one pass);
2. prefilling sequences fill the rest of the budget in arrival order (first come, first
   served), each with as large a chunk as fits (and no further than its `chunk_limit`: a hybrid
   model's prompt pauses one token before its end, where its state is kept). The oldest
   prefilling sequence always gets at least one token, so a budget taken by decode rows never
   starves a prompt;
3. a sequence running alone prefills its whole prompt in one pass (chunks only exist to keep
   others decoding), unless `chunk_alone` (the paged path on a GPU: memory is sized for the
   activations of `max_batch_tokens`, and a padded batch's masks grow with the chunk times the
   context, so a 32k-token prompt in one pass could run the device out of memory).

Pure Python: tests drive it with hand-built sequences and no model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from server.engine.sequence import Status

if TYPE_CHECKING:  # annotations only: speculative.py imports this module
    from server.engine.speculative import Draft


class Schedulable(Protocol):
    status: Status

    @property
    def num_pending(self) -> int: ...

    @property
    def session_key(self) -> Hashable | None:
        """What must not run twice at once (None: never collides)."""

    @property
    def chunk_limit(self) -> int:
        """The most tokens its next prefill chunk may take (a hybrid model pauses one token
        before its prompt's end: `Sequence.chunk_limit`)."""

    def fit(self, n: int) -> int:
        """A chunk of `n` tokens from here, or as many as end where it may (a picture computed
        in one pass: `Sequence.fit`)."""


@dataclass(slots=True)
class ScheduledRow:
    seq: Schedulable
    n_tokens: int
    # Drafted tokens computed after the pending one and verified from their logits (filled in
    # after scheduling); None: no speculation.
    draft: Draft | None = None
    # After this step nothing of the sequence is pending: its logits pick the next token (decided
    # when scheduled: the forward pass moves the sequence's KV length, and with it what is pending).
    completes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.completes = self.n_tokens == self.seq.num_pending

    @property
    def n_draft(self) -> int:
        return 0 if self.draft is None else len(self.draft.tokens)


@dataclass(slots=True)
class Admission:
    """What `admit` decided: `started` (KV reserved, in arrival order) and `refused` (sequence,
    error): "kv_budget" (it can never fit) or "internal" (reserving it failed)."""

    started: list = field(default_factory=list)
    refused: list[tuple[object, str]] = field(default_factory=list)


@dataclass(slots=True)
class Plan:
    rows: list[ScheduledRow]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes (drafted tokens included)."""
        return sum(r.n_tokens + r.n_draft for r in self.rows)


class Scheduler:
    def __init__(self, max_batch_tokens: int, max_running: int = 2**31, *, chunk_alone: bool = False) -> None:
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_alone = chunk_alone

    def admit(self, waiting: list[Schedulable], running: list[Schedulable], reserve: Callable[[Schedulable], bool]) -> Admission:
        """Which of `waiting` (arrival order) start now, beside `running` (see the module
        docstring). `reserve(seq)` reserves the sequence's KV: False when it does not fit now;
        an exception refuses that sequence ("internal") and admission goes on."""
        out = Admission()
        busy = {k for s in running if (k := s.session_key) is not None}
        for seq in waiting:
            if len(running) + len(out.started) >= self.max_running:
                break
            key = seq.session_key
            if key is not None and key in busy:
                continue
            try:
                fits = reserve(seq)
            except Exception:
                out.refused.append((seq, "internal"))
                continue
            if not fits:
                if running or out.started:
                    break  # it waits for memory, and so does the queue behind it
                out.refused.append((seq, "kv_budget"))
                continue
            if key is not None:
                busy.add(key)
            out.started.append(seq)
        return out

    def schedule(self, running: list[Schedulable]) -> Plan:
        """Rows for the next step; `running` is in admission order."""
        prefilling = [s for s in running if s.status is Status.PREFILL and s.num_pending > 0]
        if len(running) == 1 and prefilling and not self.chunk_alone:
            return Plan([ScheduledRow(prefilling[0], prefilling[0].chunk_limit)])
        rows = [ScheduledRow(s, s.num_pending) for s in running if s.status is Status.DECODE and s.num_pending > 0]
        budget = self.max_batch_tokens - sum(r.n_tokens for r in rows)
        for i, seq in enumerate(prefilling):
            n = min(seq.chunk_limit, max(budget, 1 if i == 0 else 0))
            if n <= 0:
                break
            n = seq.fit(n)
            rows.append(ScheduledRow(seq, n))
            budget -= n
        return Plan(rows)
