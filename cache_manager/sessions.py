"""Session bookkeeping: who owns which cached KV, LRU order, TTL and the byte budget.

Pure Python, no torch: an entry's `kv` is an opaque handle owned by `cache_manager/kv.py`;
the store records its size and hands it back through `on_drop` when it must be freed.
Every key is ``(principal, session_id)``, so one principal never reaches another's entry;
the only thing principals share is the byte budget.

Threading: the engine thread is the only caller that pins, commits and evicts, but the
admin routes call `list` and `delete` from other threads. One `threading.Lock` guards all
state; `on_drop` runs after the lock is released, on the thread that caused the drop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, NewType

from cache_manager.prefix import EVICTED, EXPIRED, NEW_SESSION, common_prefix_len

__all__ = [
    "ANONYMOUS_PREFIX",
    "DROP_REASONS",
    "Entry",
    "EntryPinnedError",
    "Principal",
    "SessionId",
    "SessionKey",
    "SessionStore",
    "anonymous_session_id",
    "is_anonymous",
]

Principal = NewType("Principal", str)
SessionId = NewType("SessionId", str)
SessionKey = tuple[Principal, SessionId]

DROP_REASONS: Final[tuple[str, ...]] = ("evicted", "expired", "deleted", "replaced")
ANONYMOUS_PREFIX: Final = "anon-"


def anonymous_session_id() -> SessionId:
    """A fresh id for a request without a session id (``anon-<32 hex digits>``).

    Routes should refuse client-chosen ids with this prefix so the two kinds never mix.
    """
    return SessionId(ANONYMOUS_PREFIX + uuid.uuid4().hex)


def is_anonymous(session_id: str) -> bool:
    """True for ids made by `anonymous_session_id`."""
    return session_id.startswith(ANONYMOUS_PREFIX)


class EntryPinnedError(RuntimeError):
    """The entry is in flight (pinned) and cannot be deleted now."""


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """One session's committed state: token ids whose KV is held by the `kv` handle.

    Frozen: the store replaces an entry on every change, so a caller (or the admin thread)
    holding one sees a consistent snapshot. `last_used` (clock seconds) and `pins` are set by
    the store; build new entries with the defaults. `tokens` is never mutated in place.
    """

    key: SessionKey
    tokens: list[int]
    kv: object
    nbytes: int
    last_used: float = 0.0
    pins: int = 0

    @property
    def principal(self) -> Principal:
        return self.key[0]

    @property
    def session_id(self) -> SessionId:
        return self.key[1]

    @property
    def idle(self) -> bool:
        """Not in flight: evictable and expirable."""
        return self.pins == 0


DropCallback = Callable[[Entry, str], None]


class SessionStore:
    """All session entries under one byte budget, in least-recently-used order.

    Eviction order: idle (unpinned) entries, least recently used first, where "used" means
    the last `put`, `update`, `pin` or `unpin` of the key (`get` and the lookups do not
    count). Ties are impossible: the order is that of the calls, not of clock readings.
    Pinned entries are skipped; they are never evicted or expired.

    Entries are immutable: `pin`, `unpin`, `put` and `update` return the new snapshot, and
    one obtained earlier keeps its old `pins`/`last_used`.
    """

    def __init__(
        self,
        budget_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_drop: DropCallback | None = None,
        *,
        remember_dropped: int = 10_000,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if remember_dropped < 0:
            raise ValueError(f"remember_dropped must be >= 0, got {remember_dropped}")
        self._budget = budget_bytes
        self._ttl = ttl_s
        self._clock = clock
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._entries: OrderedDict[SessionKey, Entry] = OrderedDict()  # LRU first
        self._used = 0
        # Keys dropped by eviction or expiry, oldest first, to report why a session missed.
        self._dropped: OrderedDict[SessionKey, str] = OrderedDict()
        self._remember = remember_dropped
        self._drop_counts = dict.fromkeys(DROP_REASONS, 0)

    # -- sizes and counters ---------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def limit_budget(self, budget_bytes: int) -> None:
        """Lower the budget (never raise it), for a tier that found its medium full; entries
        over the new budget stay until evicted by the next `make_room`."""
        with self._lock:
            self._budget = max(0, min(self._budget, budget_bytes))

    @property
    def used_bytes(self) -> int:
        """Sum of `nbytes` over all entries, pinned or idle."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes left under the budget without evicting anything (negative if over)."""
        return self._budget - self._used

    @property
    def drop_counts(self) -> dict[str, int]:
        """How many entries were dropped, by reason (see `DROP_REASONS`); a copy."""
        with self._lock:
            return dict(self._drop_counts)

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups --------------------------------------------------------------------

    def get(self, key: SessionKey) -> Entry | None:
        """The entry for `key`, or None. Does not change the LRU order; may expire entries."""
        with self._lock:
            dropped = self._expire_locked()
            entry = self._entries.get(key)
        self._notify(dropped)
        return entry

    def lookup_miss_reason(self, key: SessionKey) -> str:
        """Why `key` has no entry: ``evicted`` or ``expired`` if it was dropped for that reason
        within the last `remember_dropped` drops, else ``new_session`` (also for a deleted
        key, and for a key that does have an entry). May expire entries."""
        with self._lock:
            dropped = self._expire_locked()
            reason = NEW_SESSION if key in self._entries else self._dropped.get(key, NEW_SESSION)
        self._notify(dropped)
        return reason

    def best_prefix_match(
        self,
        principal: Principal,
        tokens: Sequence[int],
        *,
        idle_only: bool = True,
        anonymous_only: bool = False,
    ) -> tuple[SessionKey, int] | None:
        """The `principal`'s entry sharing the longest token prefix with `tokens`.

        Returns ``(key, n_common)`` with ``n_common > 0``, or None when no entry shares even
        the first token. Ties go to the most recently used entry. Only `principal`'s entries
        are candidates; `idle_only` skips pinned ones, `anonymous_only` skips named sessions
        (so an anonymous request cannot crop a named session's history). Does not change the
        LRU order; may expire entries. `decide_reuse` still applies the last-token rule.
        """
        best: tuple[SessionKey, int] | None = None
        with self._lock:
            dropped = self._expire_locked()
            for key, entry in reversed(self._entries.items()):  # most recently used first
                if key[0] != principal or (idle_only and not entry.idle):
                    continue
                if anonymous_only and not is_anonymous(key[1]):
                    continue
                n = common_prefix_len(entry.tokens, tokens)
                if n > 0 and (best is None or n > best[1]):
                    best = (key, n)
        self._notify(dropped)
        return best

    def list(self, principal: Principal) -> list[Entry]:
        """The `principal`'s entries, most recently used first (for the admin API).

        Entries are immutable snapshots, safe to read from another thread. May expire entries.
        """
        with self._lock:
            dropped = self._expire_locked()
            found = [e for k, e in reversed(self._entries.items()) if k[0] == principal]
        self._notify(dropped)
        return found

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first (snapshots). Does not expire anything."""
        with self._lock:
            return list(self._entries.values())

    # -- pins -----------------------------------------------------------------------

    def pin(self, key: SessionKey) -> Entry:
        """Mark `key` in flight: it is not evicted, expired or deleted until `unpin`.

        Counts nest (one per in-flight request). Touches the LRU order. Raises KeyError if the
        key has no entry. Returns the updated entry.
        """
        with self._lock:
            entry = self._require_locked(key)
            return self._store_locked(dataclasses.replace(entry, pins=entry.pins + 1))

    def unpin(self, key: SessionKey) -> Entry:
        """Undo one `pin`; the entry becomes idle at zero. Touches the LRU order and
        `last_used`, so the TTL counts from the end of the request."""
        with self._lock:
            entry = self._require_locked(key)
            if entry.pins == 0:
                raise ValueError(f"unpin of an entry that is not pinned: {key!r}")
            return self._store_locked(dataclasses.replace(entry, pins=entry.pins - 1))

    # -- insert, commit, delete -----------------------------------------------------

    def put(self, entry: Entry, *, pinned: bool = False) -> Entry:
        """Insert `entry`, or replace the entry of its key; touches the LRU order.

        The new entry keeps the old one's pin count (pins change only through `pin`/`unpin`),
        so `entry.pins` must be 0. `pinned=True` is `put` then `pin` in one step under the
        lock, so no other thread (an admin `delete`) can remove the new entry before it is
        pinned; undo it with `unpin`. When the replaced entry held a different `kv` object it
        is dropped with reason ``replaced``. Never evicts: call `make_room` before allocating.
        Returns the stored entry.
        """
        if entry.pins != 0:
            raise ValueError("a new entry must have pins == 0; use pin()")
        if entry.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {entry.nbytes}")
        dropped: list[tuple[Entry, str]] = []
        with self._lock:
            old = self._entries.get(entry.key)
            pins = 0
            if old is not None:
                pins = old.pins
                if old.kv is not entry.kv:
                    dropped.append((old, "replaced"))
                    self._drop_counts["replaced"] += 1
            self._dropped.pop(entry.key, None)
            stored = self._store_locked(
                dataclasses.replace(entry, tokens=list(entry.tokens), pins=pins + int(pinned))
            )
        self._notify(dropped)
        return stored

    def update(self, key: SessionKey, tokens: Sequence[int], kv: object, nbytes: int) -> Entry:
        """Commit new `tokens`, `kv` handle and size for an existing (usually pinned) entry.

        Touches the LRU order. If `kv` is a different object, the previous handle is dropped
        with reason ``replaced`` (its entry snapshot carries the old tokens and size).
        Raises KeyError if the key has no entry. Returns the updated entry.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        dropped: list[tuple[Entry, str]] = []
        with self._lock:
            old = self._require_locked(key)
            if old.kv is not kv:
                dropped.append((old, "replaced"))
                self._drop_counts["replaced"] += 1
            new = dataclasses.replace(old, tokens=list(tokens), kv=kv, nbytes=nbytes)
            stored = self._store_locked(new)
        self._notify(dropped)
        return stored

    def delete(self, key: SessionKey) -> bool:
        """Remove `key`'s entry (reason ``deleted``). Returns False if there was none.

        Raises `EntryPinnedError` while the entry is in flight: its tensors are in use.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if not entry.idle:
                raise EntryPinnedError(f"session is in flight: {key[1]!r}")
            self._remove_locked(entry, "deleted")
        self._notify([(entry, "deleted")])
        return True

    # -- budget ---------------------------------------------------------------------

    def can_allocate(self, nbytes: int) -> bool:
        """Whether `make_room(nbytes)` would succeed (counting idle entries as evictable).
        No side effects."""
        with self._lock:
            return self._used - self._idle_bytes_locked() + nbytes <= self._budget

    def make_room(self, nbytes: int) -> bool:
        """Ensure ``used_bytes + nbytes <= budget_bytes``, evicting idle entries in the order
        of the class docstring (least recently used first), after expiring stale ones.

        Returns False, evicting nothing (expiry aside), when even evicting every idle entry
        would not be enough: the pinned (in-flight) entries hold the rest. `nbytes` is the size
        of the allocation about to be made, not an entry's total.
        """
        with self._lock:
            dropped = self._expire_locked()
            ok = self._used - self._idle_bytes_locked() + nbytes <= self._budget
            if ok:
                for entry in list(self._entries.values()):
                    if self._used + nbytes <= self._budget:
                        break
                    if entry.idle:
                        self._remove_locked(entry, EVICTED)
                        dropped.append((entry, EVICTED))
        self._notify(dropped)
        return ok

    def evict_one(self) -> bool:
        """Evict the least recently used idle entry, for a resource other than bytes (a hybrid
        model's state slots); False when none is idle."""
        with self._lock:
            dropped = self._expire_locked()
            victim = next((e for e in self._entries.values() if e.idle), None)
            if victim is not None:
                self._remove_locked(victim, EVICTED)
                dropped.append((victim, EVICTED))
        self._notify(dropped)
        return bool(dropped)

    def expire(self) -> list[Entry]:
        """Drop idle entries unused for more than `ttl_s` (reason ``expired``); returns them."""
        with self._lock:
            dropped = self._expire_locked()
        self._notify(dropped)
        return [entry for entry, _ in dropped]

    # -- internals (callers hold the lock) ------------------------------------------

    def _require_locked(self, key: SessionKey) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def _store_locked(self, entry: Entry) -> Entry:
        """Put `entry` at the most-recently-used end with ``last_used = now``."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._used -= old.nbytes
        entry = dataclasses.replace(entry, last_used=self._clock())
        self._entries[entry.key] = entry
        self._used += entry.nbytes
        return entry

    def _remove_locked(self, entry: Entry, reason: str) -> None:
        del self._entries[entry.key]
        self._used -= entry.nbytes
        self._drop_counts[reason] += 1
        if reason in (EVICTED, EXPIRED) and self._remember > 0:
            self._dropped.pop(entry.key, None)
            self._dropped[entry.key] = reason
            while len(self._dropped) > self._remember:
                self._dropped.popitem(last=False)
        elif reason == "deleted":
            self._dropped.pop(entry.key, None)

    def _idle_bytes_locked(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.idle)

    def _expire_locked(self) -> list[tuple[Entry, str]]:
        # NOTE: `last_used` grows along the LRU order (a monotonic clock), so the scan stops at
        # the first entry, pinned or not, that is still fresh.
        now = self._clock()
        dropped: list[tuple[Entry, str]] = []
        for entry in list(self._entries.values()):
            if now - entry.last_used <= self._ttl:
                break
            if entry.idle:
                self._remove_locked(entry, EXPIRED)
                dropped.append((entry, EXPIRED))
        return dropped

    def _notify(self, dropped: Sequence[tuple[Entry, str]]) -> None:
        # NOTE: outside the lock, so the owner may free tensors or call back into the store.
        if self._on_drop is not None:
            for entry, reason in dropped:
                self._on_drop(entry, reason)
