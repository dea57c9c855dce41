"""Prompt lookup: the speculative-decoding proposer that drafts by copying.

Replies often copy their input (code edits, extraction, quoting): the tokens that followed the
sequence's last few tokens where they occurred before are a good guess of what comes next, and
finding them costs a dictionary lookup, no forward pass.
"""

from __future__ import annotations

from server.speculative import Draft


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens (n from `max_n` down to `min_n`) earlier
    in its prompt or output, and draft the tokens that followed their latest occurrence.

    A copy in progress goes first: when the tokens since the last match continue it (the
    last `min_n` tokens sit right where that match, moved forward, ends), drafting goes on
    from there, whatever other occurrences the last tokens have (code repeats its lines).

    Per sequence an index {n-gram: end position of its latest occurrence}, grown incrementally
    (only ever appended to: drafts never enter a sequence's ids, accepted tokens do)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def prepare(self) -> None:
        pass

    def limit(self, seq, k: int) -> int:
        index = seq.spec.proposer
        if index is None:
            index = seq.spec.proposer = _NgramIndex(self.min_n, self.max_n)
        index.match = self._lookup(index, seq.all_ids)
        if index.match is None:
            return 0
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
        """End position of the copy in progress, else of the latest earlier occurrence of the
        longest matching suffix."""
        index.extend(ids)
        n = self.min_n
        if index.match is not None:
            end = index.match + len(ids) - index.matched_at
            if n <= end + 1 and end < len(ids) - 1 and ids[end + 1 - n : end + 1] == ids[-n:]:
                index.matched_at = len(ids)
                return end
        index.matched_at = len(ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) > n:
                end = index.ends[n - index.min_n].get(tuple(ids[-n:]))
                if end is not None:
                    return end
        return None


class _NgramIndex:
    __slots__ = ("min_n", "ends", "indexed", "match", "matched_at")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.indexed = 0  # n-grams ending before this position are in the index
        self.match: int | None = None  # end position of the last match ...
        self.matched_at = 0  # ... found when the ids were this long

    def extend(self, ids: list[int]) -> None:
        """Index the n-grams that end at positions indexed..len(ids)-2 (each has a follower)."""
        for end in range(self.indexed, len(ids) - 1):
            for i, table in enumerate(self.ends):
                n = self.min_n + i
                if end + 1 >= n:
                    table[tuple(ids[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, len(ids) - 1)
