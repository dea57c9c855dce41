"""server/memory.py: trimming glibc's arenas gives freed heap back (RSS falls), and the idle
policy trims once per growth, not every tick; /metrics shows RSS and the disk tier's files."""

from __future__ import annotations

import ctypes
import platform

import pytest

from server import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc
def test_trim_returns_freed_small_blocks_to_the_system():
    """Blocks under the mmap threshold, every other one freed: the holes cannot coalesce into the
    arena's top, so glibc keeps their pages until trimmed."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 * 1024
    blocks = [libc.malloc(size) for _ in range(4000)]  # ~250 MiB
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[::2]:
        libc.free(b)
    held = memory.rss_bytes()
    try:
        assert memory.trim()
        assert held - memory.rss_bytes() > 100 * 2**20  # ~125 MiB of holes handed back
    finally:
        for b in blocks[1::2]:
            libc.free(b)


def test_the_trimmer_is_due_once_per_growth(monkeypatch):
    rss = {"now": 100 * 2**20}
    calls = []
    monkeypatch.setattr(memory, "rss_bytes", lambda: rss["now"])
    monkeypatch.setattr(memory, "trim", lambda: calls.append(1) or True)
    trimmer = memory.Trimmer(min_growth=16 * 2**20)
    assert not trimmer.due()
    rss["now"] += 20 * 2**20
    assert trimmer.due() and trimmer.trim() and len(calls) == 1
    assert not trimmer.due()  # nothing grew since
    rss["now"] += 8 * 2**20
    assert not trimmer.due()
    rss["now"] += 8 * 2**20
    assert trimmer.due()


def test_rss_is_known_on_linux():
    assert memory.rss_bytes() > 10 * 2**20


def test_metrics_export_rss_and_what_the_disk_tier_takes(tmp_path):
    from types import SimpleNamespace

    from cache_manager import kv
    from cache_manager.tiers import DiskTier
    from server.metrics import Metrics
    from tests.cache_manager.test_disk import FP, session_kv

    tier = DiskTier(tmp_path, 2**40, 60.0, FP)
    assert tier.park(("ph", "s"), list(range(200)), kv.export(session_kv(200)))
    tier.flush()
    metrics = Metrics()
    metrics.watch_tiers(SimpleNamespace(disk=tier, tier_usage=lambda: {t: (0, 0, 0) for t in ("device", "host", "disk")}))
    samples = {s.name: s.value for family in metrics.registry.collect() for s in family.samples}
    assert samples["process_resident_memory_bytes"] > 10 * 2**20
    assert samples["kvserve_kv_disk_file_bytes"] == sum(p.stat().st_blocks * 512 for p in tmp_path.glob("*.kv")) > 0
    assert samples["kvserve_kv_disk_free_bytes"] > 0


def test_the_engine_trims_once_nothing_runs(smollm2, monkeypatch):
    import asyncio

    from cache_manager.manager import CacheConfig, CacheManager
    from server.engine.core import Engine, EngineConfig
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest

    cache = CacheManager(smollm2.model.config, smollm2.device, smollm2.dtype, smollm2.max_context, CacheConfig(budget_bytes=2**28))
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_context=smollm2.max_context, expire_every_s=0.02), cache)
    running_at_trim = []
    monkeypatch.setattr(engine.trimmer, "due", lambda: True)
    monkeypatch.setattr(engine.trimmer, "trim", lambda: running_at_trim.append(len(engine._running)) or True)
    engine.start()
    try:
        async def generate():
            async for _ in engine.submit(GenerationRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=24, temperature=0.0)), asyncio.get_running_loop()):
                pass
            await asyncio.sleep(0.3)

        asyncio.run(generate())
    finally:
        engine.stop()
    assert running_at_trim and set(running_at_trim) == {0}  # trimmed while idle, never mid-request


def test_freezing_the_heap_takes_start_up_objects_out_of_full_collections():
    """In a fresh process (the freeze is once per process): what is alive is frozen, a second
    call freezes nothing, and a cycle made afterwards is still collected."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import gc, weakref
from server import memory
class Node: pass
alive = Node()
frozen = memory.freeze_heap()
assert frozen > 1000 and gc.get_freeze_count() == frozen, frozen
assert memory.freeze_heap() == 0
assert all(o is not alive for o in gc.get_objects()), "alive is frozen: no longer walked"
later = Node(); later.me = later; gone = weakref.ref(later); del later
gc.collect()
assert gone() is None, "a cycle made after the freeze is collected"
print("ok", frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr
