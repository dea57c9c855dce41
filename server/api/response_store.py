"""Stored responses (`store: true`): pure bookkeeping with a byte budget, optionally on disk.

Each `StoredResponse` is self-contained: it holds the whole conversation up to and including its
own output, so it stays continuable (`previous_response_id`) whatever else is evicted or
deleted. A chain of n turns therefore costs about n^2/2 turns of bytes (counted in full; in
memory the items are shared between a response and its continuations).

Eviction order: least recently used first (created, retrieved, listed or continued counts as a
use), until the stored bytes fit the budget. A response larger than the whole budget is not
stored at all (the response object then says `"store": false`). An evicted or deleted id is
404, exactly like one that never existed.

In progress: while a stored turn runs, its record (the response object `in_progress`) is held
apart (`begin`): retrievable, not counted in the budget, never written to disk; `put` replaces
it when the turn ends, `abandon` drops it when the turn fails or the client leaves.

Persistence: with a directory (the server passes `<--kv-disk-dir>/responses`), every stored
response is also written to `<id>.json` (atomically, on one background thread, in order) and
removed when evicted or deleted; `load()` reads the directory back at start, oldest first, and
applies the budget. So a response, and the session its KV lives in, survive a restart together.
No torch import: tests of the bookkeeping need no model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".json"
EVICTION_REASONS = ("evicted", "deleted")
_SAFE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(slots=True)
class StoredResponse:
    """One stored response: who owns it, which session holds its KV, what it said."""

    id: str
    principal: str
    session_id: str | None  # the kvserve session a continuation uses (None: not continuable by KV)
    response: dict  # the response object as returned to the client
    input_items: list[dict]  # this turn's input items, with ids (for /input_items)
    conversation: list[dict]  # every item up to this response: earlier turns, input, output
    nbytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps({
            "version": FORMAT_VERSION, "id": self.id, "principal": self.principal, "session_id": self.session_id,
            "response": self.response, "input_items": self.input_items, "conversation": self.conversation,
        }, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        """Raises ValueError (or KeyError/TypeError) on anything but this format."""
        raw = json.loads(data)
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown format version {raw.get('version')!r}")
        record = cls(raw["id"], raw["principal"], raw["session_id"], raw["response"], raw["input_items"], raw["conversation"])
        if not (isinstance(record.id, str) and _SAFE_ID.match(record.id) and isinstance(record.principal, str)
                and isinstance(record.response, dict) and isinstance(record.input_items, list)
                and isinstance(record.conversation, list)):
            raise ValueError("malformed record")
        record.nbytes = len(data)
        return record


class ResponseStore:
    """Stored responses by id, bounded by `budget_bytes` (0: nothing is stored).

    Thread-safe; `put`, `get`, `delete` never block on the disk (writes and removals are queued
    on one thread, in order, so a removal never overtakes the write it undoes).
    Counters for metrics: `evictions[reason]`, `hits`, `misses`.
    """

    def __init__(self, budget_bytes: int, directory: Path | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.directory = directory
        self.nbytes = 0
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # LRU first
        self._running: dict[str, StoredResponse] = {}  # turns being generated (see `begin`)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvserve-responses") if directory else None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, record: StoredResponse, data: bytes | None = None) -> bool:
        """Store `record` (most recently used); evicts the least recently used ones until the
        budget holds. False (nothing stored) when it alone exceeds the budget."""
        data = data if data is not None else record.to_json()
        record.nbytes = len(data)
        if record.nbytes > self.budget_bytes:
            self.abandon(record.id)
            return False
        with self._lock:
            self._running.pop(record.id, None)
            old = self._entries.pop(record.id, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[record.id] = record
            self.nbytes += record.nbytes
            evicted = self._evict_over_budget()
        self._write(record.id, data)
        for gone in evicted:
            self._remove(gone.id)
        return True

    def begin(self, record: StoredResponse) -> None:
        """Holds the record of a turn still running (its response `in_progress`) until `put`
        replaces it or `abandon` drops it. Nothing is held when the store stores nothing."""
        if self.budget_bytes > 0:
            with self._lock:
                self._running[record.id] = record

    def abandon(self, response_id: str) -> None:
        """Drops a running turn's record (failed, cancelled, client gone); a stored one stays."""
        with self._lock:
            self._running.pop(response_id, None)

    def get(self, principal: str, response_id: str, *, in_progress: bool = False) -> StoredResponse | None:
        """The caller's response (a use: moves it to the end of the LRU); None when missing,
        evicted, deleted or another principal's. With `in_progress`, a turn still running is
        found too (its record's response says `"status": "in_progress"`)."""
        with self._lock:
            record = self._entries.get(response_id)
            if record is not None and record.principal == principal:
                self._entries.move_to_end(response_id)
                self.hits += 1
                return record
            record = self._running.get(response_id) if in_progress else None
            if record is None or record.principal != principal:
                self.misses += 1
                return None
            self.hits += 1
            return record

    def delete(self, principal: str, response_id: str) -> StoredResponse | None:
        """Removes the caller's response; returns it, or None when there was none to remove."""
        with self._lock:
            record = self._entries.get(response_id)
            if record is None or record.principal != principal:
                return None
            del self._entries[response_id]
            self.nbytes -= record.nbytes
            self.evictions["deleted"] += 1
        self._remove(response_id)
        return record

    def sessions_in_use(self, principal: str, session_id: str) -> int:
        """How many stored responses of `principal` continue in `session_id`."""
        with self._lock:
            return sum(1 for r in self._entries.values() if r.principal == principal and r.session_id == session_id)

    def _evict_over_budget(self) -> list[StoredResponse]:
        evicted = []
        while self.nbytes > self.budget_bytes and self._entries:
            _, record = self._entries.popitem(last=False)
            self.nbytes -= record.nbytes
            self.evictions["evicted"] += 1
            evicted.append(record)
        return evicted

    # -- disk ---------------------------------------------------------------------------------

    def load(self) -> int:
        """Reads the directory's records back (oldest file first, so the newest are the most
        recently used), deletes unreadable ones and applies the budget. Returns how many are
        stored. Call once, before serving."""
        if self.directory is None:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short
        paths = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        evicted = []
        for path in paths:
            try:
                record = StoredResponse.from_json(path.read_bytes())
                if path.name != record.id + SUFFIX:
                    raise ValueError("file name and id differ")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping unreadable stored response %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            with self._lock:
                self._entries[record.id] = record
                self.nbytes += record.nbytes
                evicted += self._evict_over_budget()
        for gone in evicted:
            self._remove(gone.id)
        return len(self._entries)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for queued writes and removals (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def _path(self, response_id: str) -> Path:
        return self.directory / (response_id + SUFFIX)

    def _write(self, response_id: str, data: bytes) -> None:
        if self._writer is not None:
            self._writer.submit(self._write_now, response_id, data)

    def _remove(self, response_id: str) -> None:
        if self._writer is not None:
            self._writer.submit(self._path(response_id).unlink, missing_ok=True)

    def _write_now(self, response_id: str, data: bytes) -> None:
        with self._lock:
            if response_id not in self._entries:
                return  # evicted or deleted before its turn came
        path = self._path(response_id)
        tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full disk: the response stays stored in memory
            log.warning("could not write stored response %s: %s", response_id, exc)
            tmp.unlink(missing_ok=True)
