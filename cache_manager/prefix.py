"""Longest common token prefix and the reuse decision (pure functions, no torch).

A session's cache holds the KV of its committed token ids. A new prompt can reuse the
cache up to the longest common prefix of the two id sequences, compared token by token
(never by a hash: two different prompts must never share KV). This module decides *how
many* cached tokens a request reuses and, when it reuses none, *why*; `cache_manager/kv.py`
then crops or grows the tensors accordingly and the engine prefills the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "DIVERGED",
    "EVICTED",
    "EXPIRED",
    "MISS_REASONS",
    "MissReason",
    "NEW_SESSION",
    "NOT_CROPPABLE",
    "RECURRENT_CHECKPOINT",
    "ROPE_SWITCH",
    "TOO_SHORT",
    "ReuseDecision",
    "common_prefix_len",
    "decide_reuse",
]

MissReason = Literal["new_session", "evicted", "expired", "diverged", "not_croppable", "too_short", "rope_switch",
                     "recurrent_checkpoint"]
"""Why a request reused no cached token (the `X-Cache-Miss-Reason` header and a metric label).

* ``new_session``: no entry for the key and none was dropped recently (first turn).
* ``evicted``: the key's entry was dropped to make room (LRU, byte budget).
* ``expired``: the key's entry was idle longer than the TTL.
* ``diverged``: an entry exists but its first token already differs from the prompt.
* ``not_croppable``: the prompt shares a prefix with the entry but does not extend it, and
  the cache's recurrent state kept no checkpoint at or before the shared prefix (the manager's
  `kv.resume`), so nothing is reusable.
* ``too_short``: the prompt is empty, or one token long and matching the entry; that last
  token must be recomputed anyway to get logits, so nothing is left to reuse. Also: the
  common prefix is shorter than one reuse block (`decide_reuse`'s `block`).
* ``rope_switch``: a LongRoPE model (Phi-3, Phi-4-mini) computes a sequence's keys with short
  rope factors up to its switch length and with long ones past it; the cached keys were
  computed with the other factors than the prompt needs (or would be cut back below the
  switch), so the prompt is recomputed, as transformers' `generate` does.
* ``recurrent_checkpoint``: a hybrid model's recurrent state cannot be cut back to where the
  prompt leaves the entry (an edited or regenerated history): the request resumed from the
  latest state kept at or before that point (`kv.checkpoint`), so fewer tokens were reused
  than match; `cached_tokens` says how many (with none kept: ``not_croppable``).

`decide_reuse` only sees token lists, so it returns ``new_session`` for an empty cache;
the caller replaces it with `SessionStore.lookup_miss_reason` (``evicted``/``expired``).
"""

NEW_SESSION: Final = "new_session"
EVICTED: Final = "evicted"
EXPIRED: Final = "expired"
DIVERGED: Final = "diverged"
NOT_CROPPABLE: Final = "not_croppable"
TOO_SHORT: Final = "too_short"
ROPE_SWITCH: Final = "rope_switch"
RECURRENT_CHECKPOINT: Final = "recurrent_checkpoint"
MISS_REASONS: Final[tuple[str, ...]] = (
    NEW_SESSION,
    EVICTED,
    EXPIRED,
    DIVERGED,
    NOT_CROPPABLE,
    TOO_SHORT,
    ROPE_SWITCH,
    RECURRENT_CHECKPOINT,
)

# NOTE: comparing slices runs in C; only the first differing chunk is scanned in Python.
_CHUNK: Final = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where `a` and `b` hold the same token id.

    Exact comparison of every id up to the first difference (or the shorter length).
    Lists and tuples may be mixed.
    """
    n = min(len(a), len(b))
    if type(a) is not type(b) or not isinstance(a, (list, tuple)):
        # NOTE: a list slice never equals a tuple slice; normalise once so chunks compare.
        a, b = list(a[:n]), list(b[:n])
    start = 0
    while start < n:
        stop = min(start + _CHUNK, n)
        if a[start:stop] != b[start:stop]:
            for i in range(start, stop):
                if a[i] != b[i]:
                    return i
        start = stop
    return n


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    """How much of a session's cache one request reuses.

    * `n_reused`: cached tokens kept; the engine prefills ``prompt[n_reused:]`` and reports
      it as ``usage.prompt_tokens_details.cached_tokens``.
    * `miss_reason`: None on a hit (``n_reused > 0``); one of `MissReason` on a miss
      (``n_reused == 0``), never None then.
    * `crop`: True on a hit that keeps fewer tokens than are cached, so the cache must be
      cut back to `n_reused` before prefilling (an edited history, a regenerated turn, or
      a fully cached prompt whose last token is recomputed). Always False on a miss: the
      whole cache is discarded and the prompt recomputed from scratch. Metrics or headers
      may call a cropping hit a partial "diverged" reuse.
    """

    n_reused: int
    miss_reason: str | None
    crop: bool = False

    def __post_init__(self) -> None:
        if self.n_reused < 0:
            raise ValueError(f"n_reused must be >= 0, got {self.n_reused}")
        if self.n_reused == 0 and self.miss_reason is None:
            raise ValueError("a decision that reuses nothing must give a miss_reason")
        if self.n_reused > 0 and self.miss_reason is not None:
            raise ValueError("a hit (n_reused > 0) has no miss_reason")
        if self.miss_reason is not None and self.miss_reason not in MISS_REASONS:
            raise ValueError(f"unknown miss_reason {self.miss_reason!r}")
        if self.crop and self.n_reused == 0:
            raise ValueError("a miss never crops (the cache is recomputed)")

    @property
    def hit(self) -> bool:
        """True when at least one cached token is reused."""
        return self.n_reused > 0


def decide_reuse(cached: Sequence[int], prompt: Sequence[int], *, block: int = 1,
                 rope_switch: int | None = None, computed: int = 0) -> ReuseDecision:
    """Decide how many of the `cached` tokens' KV a request for `prompt` reuses.

    `cached` are the session's committed token ids (empty when it has no entry). Every cache
    can be cut back to an earlier length (a recurrent state is resumed from a kept checkpoint
    by the manager, `kv.resume`, which may reuse less). `rope_switch` (LongRoPE
    models: `kv.Layout.rope_switch`) and `computed` (the tokens the cache holds KV for): keys
    of a cache longer than the switch were computed with the long factors, of a shorter one
    with the short factors, and a prompt longer than the switch needs long ones.

    Rules, in order:
      1. ``n = common_prefix_len(cached, prompt)``, capped at ``len(prompt) - 1``: a fully
         cached prompt still recomputes its last token to get the next-token logits.
         When ``n < len(cached)`` (the reuse stops inside the cached tokens), `n` is rounded
         down to a multiple of `block`: with ``block > 1`` (anonymous reuse of another
         request's entry) the count never says how many single tokens matched. A prompt
         that extends every cached token reuses them all.
      2. ``n == 0``: miss ``new_session`` (nothing cached), ``too_short`` (the prompt is
         empty, a single token that matches, or the common prefix is shorter than `block`)
         or ``diverged`` (the first id differs).
      3. With a `rope_switch`: miss ``rope_switch`` when the cached keys' factors are not
         the prompt's, or when long-factor keys would be cut back to the switch or below
         (a cache never holds long keys at a length that says short).
      4. Otherwise a hit of ``n`` tokens, with ``crop = n < len(cached)``.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not cached:
        return ReuseDecision(0, NEW_SESSION)
    common = common_prefix_len(cached, prompt)
    n = max(0, min(common, len(prompt) - 1))
    if n < len(cached):
        n -= n % block
    if n <= 0:
        return ReuseDecision(0, TOO_SHORT if common > 0 or not prompt else DIVERGED)
    crop = n < len(cached)
    if rope_switch is not None:
        long_keys = computed > rope_switch
        if long_keys != (len(prompt) > rope_switch) or (long_keys and n <= rope_switch):
            return ReuseDecision(0, ROPE_SWITCH)
    return ReuseDecision(n, None, crop=crop)
