"""Where idle sessions go below the device budget: host memory, then disk.

    device (CacheManager's store) --evicted--> host (pinned RAM) --evicted--> disk --> dropped

Each tier is a `SessionStore` of its own (byte budget, LRU order, TTL) whose handles say where
the KV is. Under pressure a tier evicts its least recently used session into the next tier
down; only the last tier drops. A restore takes a session out of the host tier (it moves up);
a disk file stays after a restore (it is the session's copy for a restart) until the session
changes and is written again, or it is evicted or deleted.

Keys below the device are ``(hash of the principal, session id)``: the disk tier outlives the
process and its files must not carry principals in the clear. Anonymous sessions (reachable
only by prefix matching among resident entries) are not demoted.

Threads: the engine thread parks and takes; the admin routes list and delete; one writer
thread writes disk files. Every store is locked; a disk file's life (written, renamed,
deleted) is ordered by `DiskTier._lock`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache_manager import disk, kv
from cache_manager.sessions import Entry, SessionKey, SessionStore

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_HEADER_MARGIN = 64 * 1024  # a session file's header and alignment, over its tensor bytes


@dataclass(slots=True)
class Parked:
    """Where a parked session's KV is: host tensors (with the CUDA event of their copy), or a
    disk file (with the future of its write)."""

    n_tokens: int
    tensors: dict[str, torch.Tensor] | None = None
    event: torch.cuda.Event | None = None
    path: Path | None = None
    written: Future = field(default_factory=Future)


class RestoreCosts:
    """Whether restoring a parked session beats recomputing it: exponential moving averages of
    the measured prefill speed (tokens/s) and of each tier's restore bandwidth (bytes/s).
    Until both are measured, restoring wins (a restore is a copy; a prefill is a forward pass).
    """

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.prefill_tps: float | None = None
        self.bandwidth: dict[str, float] = {}

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)

    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = self._mix(self.bandwidth.get(tier), nbytes / seconds)

    def worth_restoring(self, tier: str, nbytes: int, n_tokens: int) -> bool:
        bandwidth = self.bandwidth.get(tier)
        if bandwidth is None or self.prefill_tps is None:
            return True
        return nbytes / bandwidth < n_tokens / self.prefill_tps

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new


class HostTier:
    """Idle sessions' KV in host memory: pinned buffers filled by asynchronous copies on a side
    stream on CUDA (the engine's stream does not wait for them); plain copies elsewhere (the
    manager enables this tier only on CUDA: on a CPU it would be the same memory)."""

    name = HOST

    def __init__(self, budget_bytes: int, ttl_s: float, below: "DiskTier | None" = None, metrics=None) -> None:
        self.store = SessionStore(budget_bytes, ttl_s, on_drop=self._dropped)
        self.below = below
        self.metrics = metrics
        self._stream = None

    def park(self, key: SessionKey, tokens: list[int], tensors: dict[str, torch.Tensor]) -> bool:
        """Copy `tensors` (device views, no longer written) into host memory; False when they
        do not fit the budget even after demoting everything idle."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if not self.store.make_room(nbytes):
            return False
        self.store.put(Entry(key, tokens, self._copy(tensors, len(tokens)), nbytes))
        return True

    def take(self, key: SessionKey) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The session's tokens and host tensors, removed from this tier; None if absent."""
        entry = self.store.get(key)
        if entry is None:
            return None
        parked: Parked = entry.kv
        if parked.event is not None:
            parked.event.synchronize()
        self.store.delete(key)
        return entry.tokens, parked.tensors

    def delete(self, key: SessionKey) -> bool:
        return self.store.delete(key)

    def _copy(self, tensors: dict[str, torch.Tensor], n_tokens: int) -> Parked:
        first = next(iter(tensors.values()))
        if first.device.type != "cuda":
            return Parked(n_tokens, tensors=kv.to_cpu(tensors, copy=True))
        if self._stream is None:
            self._stream = torch.cuda.Stream(first.device)
        self._stream.wait_stream(torch.cuda.current_stream(first.device))
        host = {}
        with torch.cuda.stream(self._stream):
            for name, t in tensors.items():
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
                # NOTE: the device tensors are freed when the caller drops them; this keeps the
                # allocator from reusing their memory before the side stream has read it.
                t.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Parked(n_tokens, tensors=host, event=event)

    def _dropped(self, entry: Entry, reason: str) -> None:
        if reason != "evicted" or self.below is None:
            return
        parked: Parked = entry.kv
        if parked.event is not None:
            parked.event.synchronize()
        if self.below.park(entry.key, entry.tokens, parked.tensors) and self.metrics is not None:
            self.metrics.kv_demotions.labels(DISK).inc()


class DiskTier:
    """Idle sessions' KV in files under one directory (see cache_manager/disk.py), bounded by a
    byte budget that counts every file and every write in progress. Files written by an earlier
    process are indexed at start (headers only) and loaded on first use.

    When the medium fills up (ENOSPC, a quota, a file size limit) the budget shrinks to what
    the tier holds: it stops growing and evicts to make room from then on; serving goes on.
    """

    name = DISK

    def __init__(self, directory: Path, budget_bytes: int, ttl_s: float, fingerprint: str, metrics=None, kv_dtype: str = "auto") -> None:
        """`kv_dtype`: the format the pool stores KV in (kv.KV_DTYPES); files of another are
        deleted at start and refused on read (the session is recomputed)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.metrics = metrics
        self.store = SessionStore(budget_bytes, ttl_s, on_drop=self._dropped)
        # NOTE: re-entrant: the store's drop callback (`_dropped`) runs on the thread that caused
        # the drop, which may be holding it (`_forget`, `_write`).
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-writer", initializer=_background_priority)
        self._index()

    # -- the manager's verbs -------------------------------------------------------------------

    def park(self, key: SessionKey, tokens: list[int], tensors: dict[str, torch.Tensor]) -> bool:
        """Write the session's file in the background. Reserves its bytes now; False when they
        do not fit. A session already on disk with the same tokens is not written again.

        `tensors` go to the writer thread as they are when on the CPU (they are the caller's
        to give: `kv.export`'s copies, or a host tier's buffers), else copied now.
        """
        old = self.store.get(key)
        if old is not None and old.tokens == tokens:
            self.store.put(Entry(key, tokens, old.kv, old.nbytes))  # touch
            return True
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) + 8 * len(tokens) + _HEADER_MARGIN
        # NOTE: the old file stays until the new one is renamed over it: both are counted.
        reserve = nbytes + (old.nbytes if old is not None else 0)
        if not self.store.make_room(reserve):
            self._count_write("skipped")
            return False
        cpu = kv.to_cpu(tensors, copy=False)
        parked = Parked(len(tokens), path=self.directory / disk.file_name(key[0], key[1]))
        self.store.put(Entry(key, list(tokens), parked, reserve))
        header = disk.Header(self.fingerprint, key[0], key[1], len(tokens), self.kv_dtype)
        self._writer.submit(self._write, key, parked, header, list(tokens), cpu)
        return True

    def take(self, key: SessionKey) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The session's tokens and CPU tensors, read and verified; the file stays. None if
        absent; raises disk.BadFile (after deleting the file) when it must not be used."""
        entry = self.store.get(key)
        if entry is None:
            return None
        parked: Parked = entry.kv
        if not parked.written.result():
            return None
        try:
            tokens, tensors = disk.read(parked.path, disk.Header(self.fingerprint, key[0], key[1], parked.n_tokens, self.kv_dtype))
        except disk.BadFile:
            self.delete(key)
            raise
        self.store.put(Entry(key, tokens, parked, entry.nbytes))  # touch; the tokens now known
        return tokens, tensors

    def delete(self, key: SessionKey) -> bool:
        return self.store.delete(key)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the writes queued so far; True when all finished in time."""
        done = self._writer.submit(lambda: None)
        try:
            done.result(timeout=timeout_s)
            return True
        except TimeoutError:
            return False

    def close(self, timeout_s: float | None = None) -> None:
        self.flush(timeout_s)
        self._writer.shutdown(wait=False, cancel_futures=True)

    def disk_usage(self) -> tuple[int, int]:
        """(bytes the tier's files take on the medium now, their temp files included; bytes
        free on its file system). What the files take is what the file system allocated
        (blocks), which the budget's count of file sizes can differ from. Safe from any thread."""
        used = 0
        with contextlib.suppress(OSError), os.scandir(self.directory) as found:
            for item in found:
                if item.name.endswith((disk.SUFFIX, disk.TMP_SUFFIX)):
                    with contextlib.suppress(OSError):  # a file may vanish while it is summed
                        used += item.stat(follow_symlinks=False).st_blocks * 512
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = 0
        return used, free

    # -- internals -----------------------------------------------------------------------------

    def _write(self, key: SessionKey, parked: Parked, header: disk.Header, tokens: list[int], tensors) -> None:
        # NOTE: `parked.written` is settled on every path: a restore of this session waits on it.
        try:
            size = disk.write(self.directory, parked.path.name, header, tokens, tensors)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the session is recomputable
            try:
                log.warning("writing a session file failed: %s", exc)
                self._count_write("failed")
                if getattr(exc, "errno", None) in _FULL_ERRNOS:
                    self.store.limit_budget(self.store.used_bytes - self._entry_bytes(key, parked))
                self._forget(key, parked, unlink=True)
            finally:
                parked.written.set_result(False)
            return
        try:
            self._count_write("ok")
            with self._lock:
                entry = self.store.get(key)
                if entry is not None and entry.kv is parked:
                    self.store.update(key, entry.tokens, parked, size)
                elif entry is None:  # deleted or evicted while being written: the file goes too
                    parked.path.unlink(missing_ok=True)
        finally:
            parked.written.set_result(True)

    def _entry_bytes(self, key: SessionKey, parked: Parked) -> int:
        entry = self.store.get(key)
        return entry.nbytes if entry is not None and entry.kv is parked else 0

    def _forget(self, key: SessionKey, parked: Parked, *, unlink: bool) -> None:
        with self._lock:
            entry = self.store.get(key)
            if entry is not None and entry.kv is parked:
                self.store.delete(key)
            elif unlink and entry is None:
                parked.path.unlink(missing_ok=True)

    def _dropped(self, entry: Entry, reason: str) -> None:
        # NOTE: a replaced entry's file is the path its successor's write renames over.
        if reason != "replaced":
            with self._lock:
                entry.kv.path.unlink(missing_ok=True)

    def _index(self) -> None:
        """Index the files of an earlier process, oldest first; delete what cannot be used."""
        for tmp in self.directory.glob(f"*{disk.TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)  # a write cut short (kill -9, power loss)
        found = []
        for path in self.directory.glob(f"*{disk.SUFFIX}"):
            try:
                header = disk.read_header(path)
                if header.fingerprint != self.fingerprint:
                    raise disk.BadFile("foreign", "another model or layout")
                if header.kv_dtype != self.kv_dtype:
                    raise disk.BadFile("foreign", f"KV stored as {header.kv_dtype!r} (--kv-cache-dtype)")
                if path.name != disk.file_name(header.principal, header.session_id):
                    raise disk.BadFile("principal", "not where its principal's session is looked up")
                stat = path.stat()
            except disk.BadFile as exc:
                log.info("deleting session file %s: %s", path.name, exc)
                self._count_failure(exc.reason)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, path, header, stat.st_size))
        for _, path, header, size in sorted(found, key=lambda f: f[0]):
            parked = Parked(header.n_tokens, path=path)
            parked.written.set_result(True)
            key = (header.principal, header.session_id)
            if self.store.make_room(size):
                # NOTE: tokens are read on first use; until then the entry only knows how many.
                self.store.put(Entry(key, [], parked, size))
            else:
                path.unlink(missing_ok=True)
        if found:
            log.info("disk KV tier: %d sessions (%d bytes) from an earlier run", len(self.store), self.store.used_bytes)

    def _count_write(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_disk_writes.labels(result).inc()

    def _count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_restore_failures.labels(DISK, reason).inc()


def _background_priority() -> None:
    """Writes yield the CPU to the engine thread (Linux: a thread's own nice value)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


DEFAULT_DISK_BYTES = 8 * 2**30


def budget_from_free_space(directory: Path, share: float = 0.5, cap: int = DEFAULT_DISK_BYTES) -> int:
    """Default disk budget: `cap` bytes, or less where `share` of the free space of the
    directory's file system is less.

    NOTE: a fixed cap, not a share alone: on a node's shared disk (container image layers,
    logs, an emptyDir counted against the pod's ephemeral storage) a share of the free space
    grows with the disk and gets the pod evicted; 8 GiB is what a pod can ask for without a
    dedicated volume. Set --kv-disk-bytes for a volume of the tier's own.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    return max(1, min(cap, math.floor(shutil.disk_usage(directory).free * share)))
