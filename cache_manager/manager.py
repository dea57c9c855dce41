"""What the engine asks of the cache manager: a cache for a prompt, then commit or roll back.

`acquire` looks up the session, decides how much of its KV the new prompt reuses (exact token
comparison), crops or grows the cache to fit, pins the session and hands back a `Lease`. The
engine prefills only `prompt[lease.n_reused:]`. At the end, `commit` records the tokens now in
the cache; `release` (abort, error, disconnect) keeps only what is known good: the tokens the
session had committed before, up to what this request left untouched.

Threads: `acquire`/`commit`/`release` run on the engine thread, `delete_session` on the event
loop's. A pinned entry cannot be deleted, so every change to a leased entry happens while it is
pinned, and the pin is released in a `finally`; an entry deleted before `acquire` could pin it
is a clean miss.

Anonymous reuse (a request without a session id taking over the longest matching idle
anonymous entry of its principal) stops at a multiple of `CacheConfig.anonymous_block` tokens,
unless the prompt extends the whole entry: `cached_tokens` (and the prefill time) then never
tells a request how many single tokens of another request's prompt it guessed right. Named
sessions reuse (and report) exact counts: that history is the caller's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cache_manager import kv
from cache_manager.prefix import ReuseDecision, decide_reuse
from cache_manager.sessions import (
    Entry,
    Principal,
    SessionId,
    SessionKey,
    SessionStore,
    anonymous_session_id,
    is_anonymous,
)

NO_SESSION = "no_session"  # reuse switched off, or a request that may not use a session


class NoRoom(Exception):
    """The cache does not fit the byte budget now: in-flight sessions hold the rest."""


@dataclass(slots=True)
class Lease:
    """One request's hold on a cache; the engine's only view of the cache manager's work."""

    key: SessionKey | None  # None: a private cache, freed at the end
    cache: object  # a transformers StaticCache
    n_reused: int
    miss_reason: str | None  # None on a hit
    base_tokens: list[int]  # the session's committed tokens when the request began


@dataclass(slots=True)
class CacheConfig:
    budget_bytes: int
    ttl_s: float = 1800.0
    anonymous_reuse: bool = True  # False: requests without a session id get private caches
    reuse: bool = True
    anonymous_block: int = 32  # anonymous reuse stops at a multiple of this many tokens

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be > 0")
        if self.ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        if self.anonymous_block < 1:
            raise ValueError("anonymous_block must be >= 1")


class CacheManager:
    """Sessions' KV caches for one model: reuse, crop, grow, evict. Engine thread only, except
    `list_sessions`/`delete_session`, which the admin routes call (the store is locked)."""

    def __init__(self, model_config, device: torch.device, dtype: torch.dtype, max_context: int, config: CacheConfig, metrics=None) -> None:
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        self.max_context = max_context
        self.config = config
        self.metrics = metrics
        self.store = SessionStore(config.budget_bytes, config.ttl_s, on_drop=self._dropped)
        self._private_bytes = 0  # caches of requests without a session (not in the store)
        self._lock = threading.Lock()

    # -- the engine's verbs ------------------------------------------------------------------

    def acquire(self, principal: str, session_id: str | None, prompt: list[int], capacity: int, *, private: bool = False) -> Lease:
        """A cache for `prompt` with room for `capacity` tokens; pins the session.

        May crop the session's cache (edited history), grow it (a larger bucket, KV copied),
        or evict idle sessions to fit the budget. Raises NoRoom when it cannot fit now (the
        session is left unpinned). `private`, reuse switched off, or a request without a
        session id while anonymous reuse is off: a fresh cache outside any session, freed at
        the end.
        """
        bucket = kv.capacity_bucket(capacity, self.max_context)
        if private or not self.config.reuse or (session_id is None and not self.config.anonymous_reuse):
            return self._private(prompt, bucket)
        key = self._choose_key(Principal(principal), session_id, prompt)
        entry = self._pin_existing(key)
        if entry is None:
            return self._new_entry(key, prompt, bucket)
        ok = False
        try:
            lease = self._reuse(entry, prompt, bucket)
            ok = True
            return lease
        finally:
            if not ok:
                self.store.unpin(key)
                self._gauges()

    def commit(self, lease: Lease, tokens: list[int]) -> None:
        """The request succeeded: `tokens` (prompt + generated) are now in the cache.

        Unpins the session whatever happens; if recording fails the entry is dropped (what its
        cache holds is unknown) and the error re-raised.
        """
        if lease.key is None:
            return self._free_private(lease)
        ok = False
        try:
            self.store.update(lease.key, tokens, lease.cache, kv.nbytes(lease.cache))
            ok = True
        finally:
            self._unpin(lease.key, drop=not ok)

    def release(self, lease: Lease) -> None:
        """The request ended early (abort, error, disconnect): roll back.

        The session keeps the first `n_reused` tokens of what it had committed: those are
        exactly what this request did not overwrite. (A rollback to a prefix of the last
        committed state: the next turn recomputes the rest, same output, more latency.)
        An entry left with nothing, or whose wrapped sliding window cannot be cut back, is
        dropped, and so is one whose rollback fails. The crop and the update happen while the
        entry is still pinned (an admin DELETE cannot slip in between); the pin is released
        in a `finally`.
        """
        if lease.key is None:
            return self._free_private(lease)
        keep = lease.n_reused
        cache = lease.cache
        drop = True
        try:
            if keep > 0 and (kv.length(cache) == keep or kv.can_crop(cache)):
                kv.crop(cache, keep)
                self.store.update(lease.key, lease.base_tokens[:keep], cache, kv.nbytes(cache))
                drop = False
        finally:
            self._unpin(lease.key, drop=drop)

    def expire(self) -> None:
        self.store.expire()
        self._gauges()

    # -- admin -------------------------------------------------------------------------------

    def list_sessions(self, principal: str) -> list[Entry]:
        return self.store.list(Principal(principal))

    def delete_session(self, principal: str, session_id: str) -> bool:
        """False when the caller has no such session; EntryPinnedError while it is in flight."""
        deleted = self.store.delete((Principal(principal), SessionId(session_id)))
        self._gauges()
        return deleted

    # -- internals ---------------------------------------------------------------------------

    def _pin_existing(self, key: SessionKey) -> Entry | None:
        """Pin `key`'s entry and return its pinned snapshot; None when it has none.

        NOTE: `get` first, so stale entries expire; an admin DELETE between `get` and `pin`
        (another thread) makes `pin` raise KeyError, which is a plain miss here.
        """
        if self.store.get(key) is None:
            return None
        try:
            return self.store.pin(key)
        except KeyError:
            return None

    def _new_entry(self, key: SessionKey, prompt: list[int], bucket: int) -> Lease:
        """A miss: a new, empty entry for `key`, inserted already pinned."""
        miss = self.store.lookup_miss_reason(key)
        cache = self._allocate(bucket)
        self.store.put(Entry(key, [], cache, kv.nbytes(cache)), pinned=True)
        self._observe(len(prompt), 0, miss)
        return Lease(key, cache, 0, miss, [])

    def _unpin(self, key: SessionKey, *, drop: bool) -> None:
        """End a lease on `key`: unpin it and, with `drop`, delete it (it may already be gone:
        an admin DELETE can win the race once it is unpinned)."""
        try:
            self.store.unpin(key)
            if drop:
                self.store.delete(key)
        finally:
            self._gauges()

    def _block(self, key: SessionKey) -> int:
        return self.config.anonymous_block if is_anonymous(key[1]) else 1

    def _choose_key(self, principal: Principal, session_id: str | None, prompt: list[int]) -> SessionKey:
        if session_id is not None:
            return (principal, SessionId(session_id))
        if self.config.anonymous_reuse:
            match = self.store.best_prefix_match(principal, prompt, anonymous_only=True)
            # NOTE: a match shorter than one block would reuse nothing and only clobber
            # another request's entry (every chat shares its template's first tokens).
            if match is not None and min(match[1], len(prompt) - 1) >= self.config.anonymous_block:
                return match[0]
        return (principal, anonymous_session_id())

    def _reuse(self, entry: Entry, prompt: list[int], bucket: int) -> Lease:
        cache = entry.kv
        decision: ReuseDecision = decide_reuse(entry.tokens, prompt, can_crop=kv.can_crop(cache), block=self._block(entry.key))
        n = decision.n_reused
        if n == 0 and kv.length(cache) > 0 and not kv.can_crop(cache):
            # A wrapped sliding window cannot be reset in place: start over in a new cache.
            cache = self._replace(entry, self._allocate(bucket))
        else:
            kv.crop(cache, n)
            # NOTE: recorded at once, so a failure below (NoRoom while growing) leaves the
            # entry's tokens matching what its cache holds.
            self.store.update(entry.key, entry.tokens[:n], cache, kv.nbytes(cache))
        if kv.capacity(cache) < bucket:
            cache = self._grow(entry, cache, bucket)
        self._observe(len(prompt), n, decision.miss_reason)
        return Lease(entry.key, cache, n, decision.miss_reason, list(entry.tokens))

    def _grow(self, entry: Entry, cache, bucket: int):
        """Move the session into a bigger cache (KV copied); the old one is freed after.

        NOTE: old and new caches exist together while the KV is copied, so room is made for
        the whole new cache: the old one is still counted in the store until `update`.
        """
        need = kv.bytes_for(self.model_config, bucket, self.dtype)
        if not self.store.make_room(need + self._private_bytes):
            raise NoRoom(f"growing a session's cache to {bucket} tokens needs {need} bytes beside the old one")
        bigger = kv.grow(cache, self.model_config, bucket)
        # NOTE: update() hands the old cache to on_drop ("replaced"); the tokens stay committed.
        self.store.update(entry.key, entry.tokens[: kv.length(bigger)], bigger, kv.nbytes(bigger))
        if self.metrics is not None:
            self.metrics.cache_grows.inc()
        return bigger

    def _replace(self, entry: Entry, cache):
        self.store.update(entry.key, [], cache, kv.nbytes(cache))
        return cache

    def _allocate(self, bucket: int):
        need = kv.bytes_for(self.model_config, bucket, self.dtype)
        if not self.store.make_room(need + self._private_bytes):
            raise NoRoom(f"a cache of {bucket} tokens needs {need} bytes")
        return kv.allocate(self.model_config, bucket, self.device, self.dtype)

    def _private(self, prompt: list[int], bucket: int) -> Lease:
        cache = self._allocate(bucket)
        with self._lock:
            self._private_bytes += kv.nbytes(cache)
        self._observe(len(prompt), 0, NO_SESSION)
        return Lease(None, cache, 0, NO_SESSION, [])

    def _free_private(self, lease: Lease) -> None:
        with self._lock:
            self._private_bytes -= kv.nbytes(lease.cache)
        lease.cache = None
        self._gauges()

    def _dropped(self, entry: Entry, reason: str) -> None:
        if self.metrics is not None and reason in ("evicted", "expired", "deleted"):
            self.metrics.cache_evictions.labels(reason).inc()

    def _observe(self, prompt_len: int, n_reused: int, miss_reason: str | None) -> None:
        if self.metrics is not None:
            self.metrics.prefix_queries.inc(prompt_len)
            self.metrics.prefix_hits.inc(n_reused)
            if miss_reason is not None:
                self.metrics.cache_misses.labels(miss_reason).inc()
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.sessions_resident.set(len(self.store))
            self.metrics.kv_bytes_used.set(self.store.used_bytes + self._private_bytes)
            self.metrics.kv_bytes_budget.set(self.store.budget_bytes)
