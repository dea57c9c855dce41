"""The process's own memory: its resident size, and handing freed heap back to the system.

glibc's malloc keeps what a burst freed: each thread's arena keeps its top and its free
chunks, and after one large block is freed the mmap threshold rises (up to 32 MiB), so later
blocks of that size come from the arenas too. RSS then stays at the burst's high-water mark.
`trim()` (glibc's `malloc_trim(0)`) returns the free pages of every arena to the system; it
costs a few milliseconds, so it is called when the engine has gone idle, not per step.
Off glibc (musl, macOS, an allocator that returns memory by itself) it does nothing.

Python's cyclic garbage collector is the other cost of a large heap: a full collection walks
every tracked object, and a served model's process holds ~400k of them before the first request
(torch, transformers, the model's modules, the tokenizer), none of which it will reclaim.
`freeze_heap()` takes them out of its walk once the server is ready.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import logging
import os

log = logging.getLogger(__name__)


@functools.cache
def _libc():
    """glibc's `malloc_trim`, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim() -> bool:
    """Return the free pages of every malloc arena to the system (glibc `malloc_trim(0)`).

    True when memory was released. Safe from any thread (glibc locks each arena in turn); a
    no-op returning False off glibc.
    """
    malloc_trim = _libc()
    if malloc_trim is None:
        return False
    return bool(malloc_trim(0))


def rss_bytes() -> int:
    """The process's resident set size now (Linux: /proc/self/statm); 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """When to trim, for a caller that asks on every idle tick: `due` only once RSS grew by
    `min_growth` bytes since the last `trim` (a burst, large bodies, restores), so an idle
    server reads /proc once a tick and trims once per burst, not once a second."""

    def __init__(self, min_growth: int = 16 * 2**20) -> None:
        self.min_growth = min_growth
        self.floor = rss_bytes()
        self.trims = 0

    def due(self) -> bool:
        return rss_bytes() - self.floor >= self.min_growth

    def trim(self) -> bool:
        """`trim()`, then RSS is the new floor; True when memory was released."""
        released = trim()
        self.floor = rss_bytes()
        self.trims += 1
        return released


_frozen = False


def freeze_heap() -> int:
    """Once per process, when it is ready to serve: collect once, then move every object alive
    into the collector's permanent generation (`gc.freeze`), which its full collections do not
    walk. Returns how many objects were frozen (0 at a second call).

    Why: a decode step's outputs (tokens, texts, deltas) are young objects, and every few hundred
    steps they set off a full collection, which walked the whole start-up heap: ~290 ms with
    the engine thread stopped, measured at 64 rows (bench/host.py's engine), 20 ms frozen. What
    is frozen is still freed by reference counting; only a cycle among frozen objects that later
    becomes garbage stays (the start-up heap lives as long as the process). vLLM's engine and
    SGLang's server freeze their heap after start-up for the same reason."""
    global _frozen
    if _frozen:
        return 0
    _frozen = True
    gc.collect()
    gc.freeze()
    # NOTE: handed back at exit, so that the interpreter's last collection reaches them: frozen,
    # nanobind's extension modules (Triton's) reported their objects as leaked on the way out
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
