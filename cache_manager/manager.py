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

import logging
import threading
import time
from dataclasses import dataclass

import torch

from cache_manager import disk, kv
from cache_manager.prefix import NOT_CROPPABLE, RECURRENT_CHECKPOINT, ReuseDecision, common_prefix_len, decide_reuse
from cache_manager.tiers import RestoreCosts
from cache_manager.sessions import (
    Entry,
    EntryPinnedError,
    Principal,
    SessionId,
    SessionKey,
    SessionStore,
    anonymous_session_id,
    is_anonymous,
)

log = logging.getLogger(__name__)

NO_SESSION = "no_session"  # reuse switched off, or a request that may not use a session
RESTORE_FAILED = "restore_failed"  # a parked copy existed but could not be used (see metrics)
RECOMPUTE_FASTER = "recompute_faster"  # a parked copy existed; recomputing was estimated faster
TIER_MISS_REASONS = (RESTORE_FAILED, RECOMPUTE_FASTER)
PERSIST_STEP_BYTES = 64 * 2**20  # KV copied for the disk per engine-loop pass, at most


class NoRoom(Exception):
    """The cache does not fit the byte budget now: in-flight sessions hold the rest."""


@dataclass(slots=True)
class Lease:
    """One request's hold on a cache; the engine's only view of the cache manager's work."""

    key: SessionKey | None  # None: a private cache, freed at the end
    cache: kv.SequenceKV  # in the manager's pool
    n_reused: int
    miss_reason: str | None  # None on a hit
    base_tokens: list[int]  # the session's committed tokens when the request began
    restored: str | None = None  # "host" or "disk": the KV came back from that tier


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One session as the admin API shows it: where its KV lives and how big it is."""

    session_id: str
    tier: str  # "device", "host" or "disk"
    tokens: int
    nbytes: int
    in_flight: bool
    last_used: float  # time.monotonic() seconds


@dataclass(slots=True)
class CacheConfig:
    budget_bytes: int
    ttl_s: float = 1800.0
    anonymous_reuse: bool = True  # False: requests without a session id get private caches
    reuse: bool = True
    anonymous_block: int = 32  # anonymous reuse stops at a multiple of this many tokens
    persist_every_s: float = 60.0  # resident sessions are written to the disk tier this often
    kv_dtype: str = "auto"  # how the pool stores keys and values (kv.KV_DTYPES)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be > 0")
        kv.kv_format(self.kv_dtype)  # ValueError names the choices
        if self.ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        if self.anonymous_block < 1:
            raise ValueError("anonymous_block must be >= 1")


def make_pool(model_config, budget_bytes: int, device: torch.device, dtype: torch.dtype, kv_dtype: str, max_context: int) -> kv.Pool:
    """The KV pool of a cache manager's budget (and of a tensor-parallel follower's, which
    must have the same blocks: server/engine/lockstep.py)."""
    return kv.Pool(model_config, budget_bytes, device, dtype, kv_dtype=kv_dtype, reserve_tokens=max_context)


class CacheManager:
    """Sessions' KV caches for one model: reuse, crop, grow, evict. Engine thread only, except
    `list_sessions`/`delete_session`, which the admin routes call (the store is locked)."""

    def __init__(self, model_config, device: torch.device, dtype: torch.dtype, max_context: int, config: CacheConfig, metrics=None, *, host=None, disk=None) -> None:
        """`host`, `disk`: the tiers below the device (cache_manager/tiers.py), or None."""
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        self.max_context = max_context
        self.config = config
        self.metrics = metrics
        # NOTE: the pool is the budget's blocks, and the store counts whole blocks: whatever
        # the store makes room for, the pool has the blocks of. A hybrid's recurrent-state
        # slots take their share first (kv._state_slots), counted apart (`_state_slot`).
        self.pool = make_pool(model_config, config.budget_bytes, device, dtype, config.kv_dtype, max_context)
        self.store = SessionStore(self.pool.budget_bytes, config.ttl_s, on_drop=self._dropped)
        self._private_bytes = 0  # caches of requests without a session (not in the store)
        self._lock = threading.Lock()
        self.host, self.disk = host, disk
        self.tiers = [t for t in (host, disk) if t is not None]
        self.costs = RestoreCosts()
        self._last_persist = time.monotonic()
        self._sweeping = False
        self._closed = False
        self._gauges()  # the budget and capacity are known before the first request

    # -- the engine's verbs ------------------------------------------------------------------

    def acquire(self, principal: str, session_id: str | None, prompt: list[int], capacity: int, *, private: bool = False) -> Lease:
        """A cache for `prompt` with room for `capacity` tokens; pins the session.

        May crop the session's cache (edited history), grow it (blocks appended), or evict
        idle sessions to fit the budget. Raises NoRoom when it cannot fit now (the
        session is left unpinned). `private`, reuse switched off, or a request without a
        session id while anonymous reuse is off: a fresh cache outside any session, freed at
        the end.
        """
        bucket = min(capacity, self.max_context)
        if private or not self.config.reuse or (session_id is None and not self.config.anonymous_reuse):
            return self._private(prompt, bucket)
        key = self._choose_key(Principal(principal), session_id, prompt)
        entry, tier = self._pin_existing(key), None
        if entry is None:
            entry, tier, miss = self._restore(key, prompt, bucket)
            if entry is None:
                return self._new_entry(key, prompt, bucket, miss)
        ok = False
        try:
            lease = self._reuse(entry, prompt, bucket)
            lease.restored = tier
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
            kv.trim(lease.cache)  # an idle session holds the blocks its tokens use
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
            keep = kv.resume(cache, keep) if keep > 0 else 0  # a recurrent state: to a kept one
            if keep > 0:
                kv.trim(cache)
                self.store.update(lease.key, lease.base_tokens[:keep], cache, kv.nbytes(cache))
                drop = False
        finally:
            self._unpin(lease.key, drop=drop)

    def expire(self) -> None:
        self.store.expire()
        self._gauges()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's measured prefill speed, against which restores are weighed."""
        self.costs.observe_prefill(tokens, seconds)

    # -- tiers below the device ----------------------------------------------------------------

    def persist(self, *, force: bool = False, max_bytes: int = PERSIST_STEP_BYTES) -> int:
        """Write idle named sessions whose disk copy is missing or older than their tokens to
        the disk tier, in the background; they stay resident. Returns how many were queued.

        A sweep starts once per `persist_every_s` and copies at most `max_bytes` of KV per
        call (the copies are taken on the engine thread, between steps), so it spreads over
        the next calls; `force` (shutdown) does all at once. Engine thread only.
        """
        if self.disk is None:
            return 0
        now = time.monotonic()
        if not (force or self._sweeping):
            if now - self._last_persist < self.config.persist_every_s:
                return 0
            self._sweeping, self._last_persist = True, now
        queued = copied = 0
        for entry in self.store.entries():
            if not entry.idle or is_anonymous(entry.session_id) or not entry.tokens:
                continue
            key = _tier_key(entry.key)
            on_disk = self.disk.store.get(key)
            if on_disk is not None and on_disk.tokens == entry.tokens:
                continue
            if not force and copied >= max_bytes:
                return queued  # the sweep goes on at the next call
            queued += self.disk.park(key, entry.tokens, kv.export(entry.kv))
            copied += entry.nbytes
        self._sweeping = False
        return queued

    def close(self, timeout_s: float | None = None, *, release: bool = False, persist: bool = True) -> None:
        """At shutdown: persist every idle named session (unless not `persist`: a
        tensor-parallel pool whose other ranks are gone) and wait (up to `timeout_s`) for the
        disk writes to finish; with `release` (no step runs any more) give the pool's memory
        back too. Once: a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.disk is not None:
                try:
                    if persist:
                        self.persist(force=True)
                finally:
                    self.disk.close(timeout_s)
        finally:
            if release:
                self.pool.release()

    def _restore(self, key: SessionKey, prompt: list[int], bucket: int) -> tuple[Entry | None, str | None, str | None]:
        """Bring `key`'s parked KV back from the highest tier holding it, when that is estimated
        cheaper than recomputing: (pinned entry, tier, None), or (None, None, miss reason).

        A copy that fails verification is deleted and counted (`restore_failed`); the request
        then recomputes, as on any miss.
        """
        if is_anonymous(key[1]):
            return None, None, None
        tkey = _tier_key(key)
        for tier in self.tiers:
            parked = tier.store.get(tkey)
            if parked is None:
                continue
            n = parked.kv.n_tokens
            useful = common_prefix_len(parked.tokens, prompt) if parked.tokens else n
            if not self.costs.worth_restoring(tier.name, parked.nbytes, useful):
                return None, None, RECOMPUTE_FASTER
            capacity = max(bucket, n)
            if not self.store.make_room(self._bytes_for(capacity) + self._private_bytes):
                raise NoRoom(f"restoring a session of {n} tokens needs a cache of {capacity}")
            t0 = time.perf_counter()
            try:
                taken = tier.take(tkey)
                if taken is None:
                    continue
                tokens, tensors = taken
                self._state_slot()
                cache = kv.load(self.pool, tensors, len(tokens), capacity)
            except disk.BadFile as exc:
                self._restore_failed(tier.name, exc.reason)
                return None, None, RESTORE_FAILED
            except ValueError:  # tensors that do not fit this model's layout
                tier.store.delete(tkey)
                self._restore_failed(tier.name, "foreign")
                return None, None, RESTORE_FAILED
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the copy is done (timing)
            seconds = time.perf_counter() - t0
            self.costs.observe_restore(tier.name, parked.nbytes, seconds)
            if self.metrics is not None:
                self.metrics.kv_restores.labels(tier.name).inc()
                self.metrics.kv_restore_seconds.labels(tier.name).observe(seconds)
            return self.store.put(Entry(key, tokens, cache, kv.nbytes(cache)), pinned=True), tier.name, None
        return None, None, None

    def _restore_failed(self, tier: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_restore_failures.labels(tier, reason).inc()

    def _demote(self, entry: Entry) -> None:
        """An idle named session evicted from the device goes to the first tier below with room."""
        if is_anonymous(entry.session_id) or not entry.tokens:
            return
        tensors = kv.export(entry.kv)
        for tier in self.tiers:
            if tier.park(_tier_key(entry.key), list(entry.tokens), tensors):
                if self.metrics is not None:
                    self.metrics.kv_demotions.labels(tier.name).inc()
                return

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """Per tier ("device", "host", "disk"): (bytes used, budget, sessions); an off tier is
        all zeros. Safe from any thread."""
        usage = {"device": (self.store.used_bytes + self._private_bytes, self.store.budget_bytes, len(self.store))}
        for name, tier in (("host", self.host), ("disk", self.disk)):
            usage[name] = (0, 0, 0) if tier is None else (tier.store.used_bytes, tier.store.budget_bytes, len(tier.store))
        return usage

    def capacity_tokens(self) -> int:
        """Tokens the device budget holds (whole blocks, every sequence's together; a model
        that keeps states only: every state slot's sequence at the full context)."""
        if not self.pool.block_bytes:
            return self.pool.states.num_slots * self.max_context
        return self.store.budget_bytes // self.pool.block_bytes * self.pool.block_size

    def recurrent_state(self) -> dict | None:
        """A hybrid model's recurrent state (/v1/models): its layers, the bytes one sequence's
        takes, the slots the budget gave them (each running or kept sequence holds one, each
        kept checkpoint another) and how many are free; None for other models."""
        states = self.pool.states
        if states is None:
            return None
        return {"layers": len(states.spec.layers), "bytes_per_sequence": states.spec.nbytes, "slots": states.num_slots,
                "free_slots": states.num_free, "checkpoints_per_sequence": kv.MAX_CHECKPOINTS}

    def used_tokens(self) -> int:
        """Token slots of the blocks sessions and private caches hold now."""
        if not self.pool.block_bytes:  # blocks of no bytes: count them
            return (self.pool.num_blocks - self.pool.allocator.num_free) * self.pool.block_size
        return (self.store.used_bytes + self._private_bytes) // self.pool.block_bytes * self.pool.block_size

    # -- admin -------------------------------------------------------------------------------

    def list_sessions(self, principal: str) -> list[SessionInfo]:
        """The principal's sessions in every tier (a session on the device and on disk is shown
        once, on the device), most recently used first."""
        found = {e.session_id: SessionInfo(e.session_id, "device", len(e.tokens), e.nbytes, not e.idle, e.last_used) for e in self.store.list(Principal(principal))}
        hashed = disk.hash_principal(principal)
        for tier in self.tiers:
            for e in tier.store.list(hashed):
                if e.session_id not in found:
                    found[e.session_id] = SessionInfo(e.session_id, tier.name, e.kv.n_tokens, e.nbytes, False, e.last_used)
        return sorted(found.values(), key=lambda info: info.last_used, reverse=True)

    def delete_session(self, principal: str, session_id: str) -> bool:
        """Remove the session from every tier. False when the caller has no such session;
        EntryPinnedError while it is in flight."""
        deleted = self.store.delete((Principal(principal), SessionId(session_id)))
        for tier in self.tiers:
            deleted = tier.delete(_tier_key((principal, session_id))) or deleted
        self._gauges()
        return deleted

    def drop_scope(self, scope: str) -> int:
        """Remove every session and anonymous prefix whose principal ends with `scope` (an
        unloaded LoRA adapter's, server/engine/lora.py `scope`) from every tier; how many
        sessions were dropped. The engine thread, once the scope's requests have ended (an
        entry still in flight stays)."""
        dropped = set()
        for entry in self.store.entries():
            if entry.key[0].endswith(scope):
                try:
                    if self.store.delete(entry.key):
                        dropped.add(_tier_key(entry.key))
                except EntryPinnedError:
                    log.warning("session %r of an unloaded adapter is still in flight; it stays", entry.key[1])
        for tier in self.tiers:
            for entry in tier.store.entries():
                if entry.key[0].endswith(scope) and tier.delete(entry.key):
                    dropped.add(entry.key)
        self._gauges()
        return len(dropped)

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

    def _new_entry(self, key: SessionKey, prompt: list[int], bucket: int, miss: str | None = None) -> Lease:
        """A miss: a new, empty entry for `key`, inserted already pinned."""
        miss = miss or self.store.lookup_miss_reason(key)
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

    def _bytes_for(self, capacity: int) -> int:
        return kv.bytes_for(self.model_config, capacity, self.dtype, self.config.kv_dtype)

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
        recurrent = cache.state is not None  # cut back by `kv.resume`, to a kept state
        decision: ReuseDecision = decide_reuse(entry.tokens, prompt, block=self._block(entry.key),
                                               rope_switch=self.pool.layout.rope_switch, computed=kv.length(cache))
        n = kv.resume(cache, decision.n_reused)
        reason = decision.miss_reason
        if n < decision.n_reused:
            reason = RECURRENT_CHECKPOINT if n else NOT_CROPPABLE
        if recurrent and n:
            kv.checkpoint(cache)  # this turn's starting state: an edit after it resumes here
        # NOTE: recorded at once, so a failure below (NoRoom while growing) leaves the entry's
        # tokens matching what its cache holds.
        self.store.update(entry.key, entry.tokens[:n], cache, kv.nbytes(cache))
        if kv.capacity(cache) < bucket:
            self._grow(entry, cache, bucket)
        self._observe(len(prompt), n, reason)
        return Lease(entry.key, cache, n, reason, list(entry.tokens))

    def _grow(self, entry: Entry, cache, bucket: int) -> None:
        """Give the session's cache room for `bucket` tokens: blocks appended, nothing copied."""
        need = self._bytes_for(bucket) - kv.nbytes(cache)
        if not self.store.make_room(need + self._private_bytes):
            raise NoRoom(f"growing a session's cache to {bucket} tokens needs {need} more bytes")
        kv.grow(cache, bucket)
        self.store.update(entry.key, entry.tokens[: kv.length(cache)], cache, kv.nbytes(cache))
        if self.metrics is not None:
            self.metrics.cache_grows.inc()

    def _allocate(self, bucket: int):
        need = self._bytes_for(bucket)
        if not self.store.make_room(need + self._private_bytes):
            raise NoRoom(f"a cache of {bucket} tokens needs {need} bytes")
        self._state_slot()
        return self.pool.allocate(bucket)

    def _state_slot(self) -> None:
        """A hybrid model: a free recurrent-state slot for a new cache, idle sessions evicted
        (least recently used first) until there is one. Each sequence holds one slot."""
        states = self.pool.states
        while states is not None and states.num_free == 0:
            if not self.store.evict_one():
                raise NoRoom(f"all {states.num_slots} recurrent-state slots are held by running sequences")

    def _private(self, prompt: list[int], bucket: int) -> Lease:
        cache = self._allocate(bucket)
        with self._lock:
            self._private_bytes += kv.nbytes(cache)
        self._observe(len(prompt), 0, NO_SESSION)
        return Lease(None, cache, 0, NO_SESSION, [])

    def _free_private(self, lease: Lease) -> None:
        with self._lock:
            self._private_bytes -= kv.nbytes(lease.cache)
        kv.free(lease.cache)
        lease.cache = None
        self._gauges()

    def _dropped(self, entry: Entry, reason: str) -> None:
        if self.metrics is not None and reason in ("evicted", "expired", "deleted"):
            self.metrics.cache_evictions.labels(reason).inc()
        if reason == "evicted" and self.tiers:
            self._demote(entry)
        kv.free(entry.kv)  # after the demotion's copy was taken

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
            self.metrics.kv_tokens_used.set(self.used_tokens())
            self.metrics.kv_tokens_capacity.set(self.capacity_tokens())


def _tier_key(key: tuple[str, str]) -> SessionKey:
    """Below the device, sessions are keyed by the principal's hash (files outlive the process)."""
    return (Principal(disk.hash_principal(key[0])), SessionId(key[1]))
