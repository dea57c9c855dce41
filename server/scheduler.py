"""Which running sequences one engine step computes, and how many tokens each.

One step is ONE forward pass over a batch built under a token budget (`max_batch_tokens`):

1. every decoding sequence is a row with all its pending tokens (one sampled token, or the
   tokens a grammar forced, which go through in one pass);
2. prefilling sequences fill the rest of the budget in arrival order (first come, first
   served), each with as large a chunk as fits. The oldest prefilling sequence always gets at
   least one token, so a budget taken by decode rows never starves a prompt;
3. a sequence running alone prefills its whole prompt in one pass (chunks only exist to keep
   others decoding).

Pure Python: tests drive it with hand-built sequences and no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from server.sequence import Status


class Schedulable(Protocol):
    status: Status

    @property
    def num_pending(self) -> int: ...


@dataclass(slots=True)
class ScheduledRow:
    seq: Schedulable
    n_tokens: int
    # Drafted tokens computed after the pending one and verified from their logits
    # (a server/speculative.py `Draft`, filled in after scheduling); None: no speculation.
    draft: object | None = None

    @property
    def completes(self) -> bool:
        """After this step nothing of the sequence is pending: its logits pick the next token."""
        return self.n_tokens == self.seq.num_pending

    @property
    def n_draft(self) -> int:
        return 0 if self.draft is None else len(self.draft.tokens)


@dataclass(slots=True)
class Plan:
    rows: list[ScheduledRow]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes (drafted tokens included)."""
        return sum(r.n_tokens + r.n_draft for r in self.rows)


class Scheduler:
    def __init__(self, max_batch_tokens: int) -> None:
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.max_batch_tokens = max_batch_tokens

    def schedule(self, running: list[Schedulable]) -> Plan:
        """Rows for the next step; `running` is in admission order."""
        prefilling = [s for s in running if s.status is Status.PREFILL and s.num_pending > 0]
        if len(running) == 1 and prefilling:
            return Plan([ScheduledRow(prefilling[0], prefilling[0].num_pending)])
        rows = [ScheduledRow(s, s.num_pending) for s in running if s.status is Status.DECODE and s.num_pending > 0]
        budget = self.max_batch_tokens - sum(r.n_tokens for r in rows)
        for i, seq in enumerate(prefilling):
            n = min(seq.num_pending, max(budget, 1 if i == 0 else 0))
            if n <= 0:
                break
            rows.append(ScheduledRow(seq, n))
            budget -= n
        return Plan(rows)
