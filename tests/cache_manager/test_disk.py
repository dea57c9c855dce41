"""Session files and the disk tier without a model: atomic writes (kill -9 mid-write), the byte
bound under load, indexing at start, and every kind of file that must not load."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from cache_manager import disk, kv, tiers
from cache_manager.tiers import DiskTier

FP = "fingerprint-a"
CONFIG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, vocab_size=128)


def session_kv(n_tokens: int, dtype=torch.float32) -> kv.SequenceKV:
    # NOTE: on the CPU whatever KVSERVE_TEST_DEVICE says: disk.write takes host tensors (the
    # disk tier copies a device's KV there first); what comes off the GPU is tested in tests/server.
    cache = kv.allocate(CONFIG, 256, torch.device("cpu"), dtype)
    for t in cache.pool.keys + cache.pool.values:
        t.normal_()
    cache.length = n_tokens
    return cache


def pool(dtype, capacity) -> kv.Pool:
    return kv.Pool(CONFIG, kv.bytes_for(CONFIG, capacity, dtype), torch.device("cpu"), dtype)


def header(principal="p", session="s", n=3) -> disk.Header:
    return disk.Header(FP, disk.hash_principal(principal), session, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_then_read_is_bit_identical(tmp_path, dtype):
    cache = session_kv(40, dtype)
    name = disk.file_name(disk.hash_principal("p"), "s")
    size = disk.write(tmp_path, name, header(n=40), list(range(40)), kv.export(cache))
    assert size == (tmp_path / name).stat().st_size and not list(tmp_path.glob("*.tmp"))
    tokens, tensors = disk.read(tmp_path / name, header(n=40))
    back = kv.load(pool(dtype, 512), tensors, len(tokens), 512)
    assert tokens == list(range(40)) and back.length == 40 and kv.capacity(back) == 512
    for a, b in zip(kv.export(cache).values(), kv.export(back).values()):
        assert a.shape[2] == 40 and torch.equal(a, b)


def test_names_are_hashes_of_principal_and_session():
    name = disk.file_name(disk.hash_principal("p"), "../../etc/passwd")
    assert "/" not in name and name.endswith(disk.SUFFIX) and len(name) == 40 + len(disk.SUFFIX)
    assert name != disk.file_name(disk.hash_principal("q"), "../../etc/passwd")


@pytest.mark.parametrize(
    ("expected", "reason"),
    [(disk.Header("fingerprint-b", disk.hash_principal("p"), "s", 3), "foreign"),
     (header(principal="q"), "principal"),
     (header(session="t"), "principal")],
)
def test_a_file_of_another_model_principal_or_session_is_refused(tmp_path, expected, reason):
    disk.write(tmp_path, "f.kv", header(), [1, 2, 3], kv.export(session_kv(3)))
    with pytest.raises(disk.BadFile) as info:
        disk.read(tmp_path / "f.kv", expected)
    assert info.value.reason == reason


def test_layout_mismatch_is_refused_by_load():
    tensors = kv.export(session_kv(3))
    other = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, vocab_size=128)
    with pytest.raises(ValueError):
        kv.load(kv.Pool(other, kv.bytes_for(other, 256, torch.float32), torch.device("cpu"), torch.float32), tensors, 3, 256)
    with pytest.raises(ValueError):
        kv.load(pool(torch.bfloat16, 256), tensors, 3, 256)


def test_kill_9_during_writes_leaves_no_file_that_loads_wrong(tmp_path):
    """A writer killed at random points: only complete files (which load) and temp files
    (which indexing deletes) remain."""
    script = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {str(sys.path[0])!r})
        from cache_manager import disk
        big = {{"k.0": torch.randn(1, 2, 4_000_000, 8), "v.0": torch.randn(1, 2, 4_000_000, 8)}}
        for i in range(1000):
            h = disk.Header({FP!r}, "ph", f"s{{i % 3}}", 2)
            disk.write(__import__("pathlib").Path({str(tmp_path)!r}), disk.file_name("ph", f"s{{i % 3}}"), h, [1, 2], big)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=str(sys.path[0]))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.tmp")) or not list(tmp_path.glob("*.kv")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()  # SIGKILL, mid-write: a temp file exists
    proc.wait()
    for path in tmp_path.glob("*.kv"):
        tokens, tensors = disk.read(path, disk.read_header(path))  # complete, checksum good
        assert tokens == [1, 2] and tensors["k.0"].shape == (1, 2, 4_000_000, 8)
    tier = DiskTier(tmp_path, 2**40, 60.0, FP)
    assert not list(tmp_path.glob("*.tmp"))
    assert len(tier.store) == len(list(tmp_path.glob("*.kv"))) >= 1


def du(directory) -> int:
    """Bytes of the files in `directory` now (a file may vanish while it is summed)."""
    total = 0
    for path in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def test_the_byte_bound_holds_while_sessions_are_written(tmp_path):
    one = sum(t.numel() * t.element_size() for t in kv.export(session_kv(200)).values())
    budget = int(one * 2.5) + 3 * 64 * 1024
    tier = DiskTier(tmp_path, budget, 60.0, FP)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], du(tmp_path))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(12):  # new sessions and new versions of old ones, no waiting in between
            assert tier.park(("ph", f"s{i % 5}"), list(range(200 + i)), kv.export(session_kv(200)))
            assert tier.store.used_bytes <= budget
        tier.flush()
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= budget
    assert du(tmp_path) <= budget
    # The most recent sessions stay, as many as fit: two while the writer lags (an old file and
    # its new version are both counted until the rename), three once every write has landed
    # (an H200 machine's disk).
    kept = len(tier.store)
    assert kept == len(list(tmp_path.glob("*.kv"))) and kept in (2, 3)
    assert all(tier.store.get(("ph", f"s{i % 5}")) is not None for i in range(12 - kept, 12))


def test_indexing_keeps_good_files_and_deletes_the_rest(tmp_path):
    cache = session_kv(5)
    good = disk.file_name("ph", "good")
    disk.write(tmp_path, good, disk.Header(FP, "ph", "good", 5), [1, 2, 3, 4, 5], kv.export(cache))
    disk.write(tmp_path, disk.file_name("ph", "old"), disk.Header("old-model", "ph", "old", 5), [1, 2, 3, 4, 5], kv.export(cache))
    disk.write(tmp_path, "renamed.kv", disk.Header(FP, "ph", "x", 5), [1, 2, 3, 4, 5], kv.export(cache))
    (tmp_path / "empty.kv").write_bytes(b"")
    (tmp_path / "garbage.kv").write_bytes(b"\xff" * 100)
    (tmp_path / "cut.tmp").write_bytes(b"\x00" * 10)
    tier = DiskTier(tmp_path, 2**40, 60.0, FP)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good]
    assert [e.key for e in tier.store.entries()] == [("ph", "good")]
    tokens, tensors = tier.take(("ph", "good"))
    assert tokens == [1, 2, 3, 4, 5] and torch.equal(tensors["k.0"], kv.export(cache)["k.0"])


def test_deleting_removes_the_file_and_a_write_in_flight_leaves_nothing(tmp_path):
    tier = DiskTier(tmp_path, 2**40, 60.0, FP)
    assert tier.park(("ph", "s"), [1, 2, 3], kv.export(session_kv(3)))
    assert tier.delete(("ph", "s"))  # possibly before the writer got to it
    tier.flush()
    assert list(tmp_path.iterdir()) == [] and len(tier.store) == 0


def test_a_full_medium_fails_the_write_and_shrinks_the_budget_without_hanging(tmp_path):
    """Under a file size limit (EFBIG, as ENOSPC would be): `disk.write` raises the OSError, the
    tier forgets the session (a restore of it returns None at once, never waits forever) and
    stops growing; sessions whose files fit are still written and restored."""
    script = textwrap.dedent(f"""
        import errno, pathlib, resource, sys, torch
        sys.path.insert(0, {str(sys.path[0])!r})
        from cache_manager import disk
        from cache_manager.tiers import DiskTier
        limit = 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        directory = pathlib.Path({str(tmp_path)!r})
        small, big = {{"k.0": torch.ones(1, 2, 16, 8)}}, {{"k.0": torch.ones(1, 2, 40_000, 8)}}
        try:
            disk.write(directory, "x.kv", disk.Header({FP!r}, "ph", "x", 1), [1], big)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
        else:
            raise AssertionError("a write over the limit succeeded")
        tier = DiskTier(directory, 2**30, 60.0, {FP!r})
        assert tier.park(("ph", "small"), [1, 2], small) and tier.park(("ph", "big"), [1, 2], big)
        assert tier.take(("ph", "big")) is None
        assert tier.take(("ph", "small"))[0] == [1, 2]
        assert tier.store.budget_bytes < 2**30 and len(tier.store) == 1
        assert sorted(p.name for p in directory.iterdir()) == [disk.file_name("ph", "small")]
    """)
    subprocess.run([sys.executable, "-c", script], cwd=str(sys.path[0]), check=True, timeout=60)


def test_the_default_budget_is_8_gib_or_half_the_free_space_where_that_is_less(tmp_path, monkeypatch):
    free = {"bytes": 100 * 2**30}
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda _: SimpleNamespace(free=free["bytes"]))
    assert tiers.budget_from_free_space(tmp_path / "kv") == tiers.DEFAULT_DISK_BYTES == 8 * 2**30
    free["bytes"] = 10 * 2**30
    assert tiers.budget_from_free_space(tmp_path / "kv") == 5 * 2**30
    assert (tmp_path / "kv").is_dir()


def test_disk_usage_counts_the_tiers_files_as_allocated(tmp_path):
    tier = DiskTier(tmp_path, 2**40, 60.0, FP)
    assert tier.disk_usage()[0] == 0 and tier.disk_usage()[1] > 0
    (tmp_path / "responses").mkdir()
    (tmp_path / "responses" / "r.json").write_bytes(b"x" * 10_000)  # not the tier's
    assert tier.park(("ph", "s"), list(range(200)), kv.export(session_kv(200)))
    tier.flush()
    files = list(tmp_path.glob("*.kv"))
    assert tier.disk_usage()[0] == sum(p.stat().st_blocks * 512 for p in files) >= du(tmp_path) - 4096


def test_the_disk_tier_evicts_least_recently_used_files_to_stay_within_its_budget(tmp_path):
    """A park reserves its file's size plus a header margin; once written, the file's size counts.
    The budget holds three files, not three files and a fourth's reservation."""
    reserve = sum(t.numel() * t.element_size() for t in kv.export(session_kv(200)).values()) + 200 * 8 + 64 * 1024
    probe = DiskTier(tmp_path / "probe", 2**40, 60.0, FP)
    probe.park(("ph", "p"), list(range(200)), kv.export(session_kv(200)))
    probe.flush()
    size = probe.store.used_bytes
    budget = 2 * size + reserve + size // 2
    tier = DiskTier(tmp_path / "kv", budget, 60.0, FP)
    for i in range(3):
        assert tier.park(("ph", f"s{i}"), list(range(200)), kv.export(session_kv(200)))
        tier.flush()
    assert tier.take(("ph", "s0")) is not None  # s0 used: s1 is now the least recently used
    assert tier.park(("ph", "s3"), list(range(200)), kv.export(session_kv(200)))
    tier.flush()
    assert sorted(e.session_id for e in tier.store.entries()) == ["s0", "s2", "s3"]
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 3 and tier.store.used_bytes <= budget
