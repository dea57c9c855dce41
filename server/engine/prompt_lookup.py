"""Prompt lookup: the speculative-decoding proposer that drafts by copying.

Replies often copy their input (code edits, extraction, quoting): the tokens that followed the
sequence's last few tokens where they occurred before are a good guess of what comes next, and
finding them costs a dictionary lookup, no forward pass.
"""

from __future__ import annotations

import bisect

from server.engine.speculative import Draft


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens (n from `max_n` down to `min_n`) earlier
    in its prompt or output, and draft the tokens that followed that occurrence.

    Which occurrence, in this order:
    * A copy in progress: when the tokens since the last match continue it (the last `min_n`
      tokens sit right where that match, moved forward, ends), drafting goes on from there,
      whatever other occurrences the last tokens have (code repeats its lines).
    * For n >= RESUME_MIN_N, the first occurrence in the prompt past the furthest point a
      copy from the prompt has reached: an edit copies its source in order, so after the
      reply departs from it (a renamed or rewritten function) it resumes further on, not at
      the latest place the same tokens occur (often the reply's own previous function).
    * Else the latest occurrence.

    (Applied to one-token matches too, RESUME_MIN_N 1, it lost on two of the Python replies:
    docs/benchmarks.md, "The drafting rules".)

    Each match names its source, the prompt or the reply's own earlier text (`SpecState.source`),
    whose acceptance is counted apart: in structured output, what follows a key earlier in the
    reply is another key's value, while values copied from the document are long runs; in a
    code edit the reply repeats itself less reliably than it copies its input (what a rate
    per source gained: docs/benchmarks.md, "The drafting rules").

    Per sequence an index {n-gram: end positions of its occurrences, ascending}, grown
    incrementally (only ever appended to: drafts never enter a sequence's ids, accepted tokens
    do)."""

    RESUME_MIN_N = 2

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def prepare(self) -> None:
        pass

    def limit(self, seq, k: int) -> int:
        index = seq.spec.proposer
        if index is None:
            index = seq.spec.proposer = _NgramIndex(self.min_n, self.max_n, len(seq.prompt_ids))
        index.match = self._lookup(index, seq.all_ids)
        if index.match is None:
            return 0
        seq.spec.source = "prompt" if index.match + 1 < index.n_prompt else "output"  # where the draft starts
        return min(k, len(seq.all_ids) - index.match - 1)

    def propose(self, seqs: list, ks: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            start = seq.spec.proposer.match + 1
            drafts.append(Draft(seq.all_ids[start : start + k]))
        return drafts

    def peek(self, seq) -> int | None:
        return seq.all_ids[seq.spec.proposer.match + 1]

    def token_seconds(self) -> float:
        return 0.0

    def rewind(self, seq, n_valid: int) -> None:
        pass

    def release(self, seq, committed: bool) -> None:
        seq.spec.proposer = None

    def _lookup(self, index: "_NgramIndex", ids: list[int]) -> int | None:
        """End position of the occurrence to copy from (see the class), or None."""
        index.extend(ids)
        n = self.min_n
        if index.match is not None:
            end = index.match + len(ids) - index.matched_at
            if n <= end + 1 and end < len(ids) - 1 and ids[end + 1 - n : end + 1] == ids[-n:]:
                index.matched_at = len(ids)
                if end < index.n_prompt:
                    index.reached = max(index.reached, end)
                return end
        index.matched_at = len(ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) > n:
                ends = index.ends[n - index.min_n].get(tuple(ids[-n:]))
                if ends:
                    if n >= self.RESUME_MIN_N:
                        i = bisect.bisect_right(ends, index.reached)
                        if i < len(ends) and ends[i] < index.n_prompt:
                            return ends[i]
                    return ends[-1]
        return None


class _NgramIndex:
    __slots__ = ("min_n", "n_prompt", "ends", "indexed", "match", "matched_at", "reached")

    def __init__(self, min_n: int, max_n: int, n_prompt: int) -> None:
        self.min_n = min_n
        self.n_prompt = n_prompt  # ids before this position are the prompt
        self.ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(min_n, max_n + 1)]
        self.indexed = 0  # n-grams ending before this position are in the index
        self.match: int | None = None  # end position of the last match ...
        self.matched_at = 0  # ... found when the ids were this long
        self.reached = -1  # the furthest prompt position a copy in progress has reached

    def extend(self, ids: list[int]) -> None:
        """Index the n-grams that end at positions indexed..len(ids)-2 (each has a follower)."""
        for end in range(self.indexed, len(ids) - 1):
            for i, table in enumerate(self.ends):
                n = self.min_n + i
                if end + 1 >= n:
                    table.setdefault(tuple(ids[end + 1 - n : end + 1]), []).append(end)
        self.indexed = max(self.indexed, len(ids) - 1)
