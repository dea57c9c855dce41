"""KV tiers on the real model: sessions evicted from the device go to host memory or disk and
come back bit-identical; sessions written to disk survive a restart (a new engine over the same
directory); files that must not be used are deleted and recomputed, never served.

Every turn is checked against a fresh prefill of the same prompt (tests/equivalence.py) and its
cached_tokens against the session's committed tokens.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import time

import pytest
import torch

from cache_manager import disk, kv
from server.engine import model_runner
from server.engine.attention import Row
from cache_manager.tiers import DiskTier, HostTier
from server.metrics import Metrics
from server.model_loader import load_model
from tests.conftest import test_cache_dir as cache_dir
from tests.device import DEVICE
from tests.engines import stopped_after
from tests.server.test_sessions import Harness, conversation_start
from tests.server.test_sessions import one_session as session_budget

FINGERPRINT = "test-model"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a GPU")
# On CPU the suite's model and, where a GPU exists, one on CUDA; on the test device alone otherwise.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)] if DEVICE.type == "cpu" else [DEVICE.type]


@functools.cache
def cuda_model():
    # NOTE: fp32 on CUDA too: the fresh-prefill references follow the same near-tie rule.
    return load_model(None, cache_dir=cache_dir(), device="cuda", dtype="float32")


@pytest.fixture(params=DEVICES)
def loaded(request):
    """The real model on each device at hand: every test here runs on CPU and, where a GPU
    exists, on CUDA (pinned host buffers, side-stream copies, restores into device memory)."""
    return request.getfixturevalue("smollm2") if request.param == DEVICE.type else cuda_model()


@pytest.fixture
def harness(loaded):
    yield from stopped_after(lambda **kw: Harness(loaded.model, loaded.tokenizer, loaded.max_context, **kw))


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def one_session(loaded) -> int:
    return session_budget(loaded)


def disk_tier(path, metrics=None, budget=2**31, fingerprint=FINGERPRINT, kv_dtype="auto") -> DiskTier:
    return DiskTier(path, budget, 1800.0, fingerprint, metrics, kv_dtype=kv_dtype)


async def chat(h, sid, messages, reference, question):
    """One more user turn in `messages`, played through `h` and checked; the reply appended."""
    messages.append({"role": "user", "content": question})
    tokens, final = await h.turn(sid, h.prompt(messages), reference=reference)
    messages.append({"role": "assistant", "content": h.reply(tokens)})
    return final


def test_sessions_demoted_to_disk_come_back_identical(harness, tmp_path, one_session):
    metrics = Metrics()
    tier = disk_tier(tmp_path, metrics)
    h = harness(budget=one_session, tiers={"disk": tier}, metrics=metrics)
    reference = harness()

    async def play():
        convs = {sid: conversation_start(k) for k, sid in [(1, "a"), (2, "b")]}
        for turn in range(3):
            for sid, messages in convs.items():
                final = await chat(h, sid, messages, reference, f"Question {turn}?")
                if turn > 0:  # the other session evicted this one: it came back from disk
                    assert final.miss_reason == "restored_disk" and final.cached_tokens > 0, sid

    asyncio.run(play())
    assert sample(metrics, "kvserve_kv_demotions_total", tier="disk") >= 4
    assert sample(metrics, "kvserve_kv_restores_total", tier="disk") >= 4
    listed = {s.session_id: s.tier for s in h.cache.list_sessions("alice")}
    assert sorted(listed.values()) == ["device", "disk"]
    tier.flush()
    assert len(list(tmp_path.glob("*.kv"))) == 2 and not list(tmp_path.glob("*.tmp"))


def test_restore_of_an_edited_history_crops_after_restoring(harness, tmp_path, one_session):
    h = harness(budget=one_session, tiers={"disk": disk_tier(tmp_path)})
    reference = harness()

    async def play():
        messages = conversation_start(3)
        await chat(h, "s", messages, reference, "Name a fruit.")
        await chat(h, "s", messages, reference, "And a vegetable?")
        await chat(h, "other", conversation_start(5), reference, "Hi")  # evicts "s" to disk
        edited = [dict(m) for m in messages[:2]] + [{"role": "user", "content": "Name a color."}]
        edited[1]["content"] = "Name a tree."
        _, final = await h.turn("s", h.prompt(edited), reference=reference)
        assert final.miss_reason == "restored_disk"
        assert 0 < final.cached_tokens < len(h.prompt(edited)) - 5  # cropped where it changed

    asyncio.run(play())


def test_host_tier_overflows_to_disk_and_both_restore(harness, tmp_path, one_session):
    """The host tier's code path on a CPU (the server enables it on CUDA only)."""
    metrics = Metrics()
    below = disk_tier(tmp_path, metrics)
    host = HostTier(one_session, 1800.0, below=below, metrics=metrics)  # 112 tokens
    h = harness(budget=one_session, tiers={"host": host, "disk": below}, metrics=metrics)
    reference = harness()
    # the device holds one session, the host 112 tokens (one session of these, not two)
    plan = [("a", "new_session"), ("b", "new_session"), ("a", "restored_host"), ("c", "new_session"), ("b", "restored_disk")]

    async def play():
        convs = {sid: conversation_start(k) for k, sid in [(1, "a"), (2, "b"), (5, "c")]}
        for turn, (sid, expected) in enumerate(plan):
            final = await chat(h, sid, convs[sid], reference, f"Question {turn}?")
            assert final.miss_reason == expected, (turn, sid)

    asyncio.run(play())
    assert sample(metrics, "kvserve_kv_demotions_total", tier="host") == 4
    assert sample(metrics, "kvserve_kv_demotions_total", tier="disk") == 2


async def _first_turn(h, sid, reference):
    messages = conversation_start(6)
    await chat(h, sid, messages, reference, "Tell me about rain.")
    return messages


def test_a_restart_finds_persisted_sessions(harness, tmp_path):
    metrics = Metrics()
    first = harness(tiers={"disk": disk_tier(tmp_path)})
    reference = harness()
    messages = asyncio.run(_first_turn(first, "kept", reference))
    first.cache.close(timeout_s=30)  # what SIGTERM does after the drain
    first.stop()
    assert len(list(tmp_path.glob("*.kv"))) == 1

    second = harness(tiers={"disk": disk_tier(tmp_path, metrics)}, metrics=metrics)  # a new process
    second.committed = dict(first.committed)
    assert [(s.session_id, s.tier) for s in second.cache.list_sessions("alice")] == [("kept", "disk")]
    assert second.cache.list_sessions("bob") == []

    async def play():
        final = await chat(second, "kept", messages, reference, "And snow?")
        assert final.miss_reason == "restored_disk" and final.cached_tokens > 0
        # another principal with the same session id finds nothing of alice's
        _, other = await second.generate(second.prompt(messages), "kept", principal="bob")
        assert other.cached_tokens == 0 and other.miss_reason == "new_session"

    asyncio.run(play())
    assert sample(metrics, "kvserve_kv_restores_total", tier="disk") == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_principal", "foreign_model"])
def test_files_that_must_not_be_used_are_deleted_and_recomputed(harness, tmp_path, damage):
    first = harness(tiers={"disk": disk_tier(tmp_path)})
    reference = harness()
    messages = asyncio.run(_first_turn(first, "s", reference))
    asyncio.run(first.generate(first.prompt(conversation_start(7)), "s", principal="bob"))
    first.cache.close(timeout_s=30)
    first.stop()
    metrics = Metrics()
    fingerprint = "another-model" if damage == "foreign_model" else FINGERPRINT
    second = harness(tiers={"disk": disk_tier(tmp_path, metrics, fingerprint=fingerprint)}, metrics=metrics)
    # damaged after the new process indexed the files: found out only when loaded
    path = tmp_path / disk.file_name(disk.hash_principal("alice"), "s")
    if damage == "flip":  # one bit of the KV data
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 0x01
        path.write_bytes(bytes(blob))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "other_principal":  # bob's file where alice's is looked up (a shared volume)
        shutil.copy(tmp_path / disk.file_name(disk.hash_principal("bob"), "s"), path)

    async def play():
        messages.append({"role": "user", "content": "And snow?"})
        _, final = await second.turn("s", second.prompt(messages), reference=reference)
        return final

    final = asyncio.run(play())  # checked against a fresh prefill, like every turn
    assert final.cached_tokens == 0 and not path.exists()
    if damage == "foreign_model":  # both files deleted when indexed, before any request
        assert final.miss_reason == "new_session"
        assert sample(metrics, "kvserve_kv_restore_failures_total", tier="disk", reason="foreign") == 2
    else:
        assert final.miss_reason == "restore_failed"
        reason = {"flip": "corrupt", "truncate": "truncated", "other_principal": "principal"}[damage]
        assert sample(metrics, "kvserve_kv_restore_failures_total", tier="disk", reason=reason) == 1


@CUDA
def test_host_tier_on_cuda_parks_pinned_copies_and_restores_them_bit_identical():
    loaded = cuda_model()
    device = torch.device("cuda")
    cache = kv.allocate(loaded.model.config, 256, device, loaded.dtype)
    ids = loaded.tokenizer("Pinned host buffers and a side stream.")["input_ids"]
    model_runner.forward_rows(loaded.model, [Row(cache, len(ids))], ids, [0])
    host = HostTier(2**30, 60.0)
    assert host.park(("p", "s"), ids, kv.export(cache))
    parked = host.store.get(("p", "s")).kv
    assert all(t.is_pinned() for t in parked.tensors.values()) and parked.event is not None
    tokens, tensors = host.take(("p", "s"))
    pool = kv.Pool(loaded.model.config, kv.bytes_for(loaded.model.config, 512, loaded.dtype), device, loaded.dtype)
    back = kv.load(pool, tensors, len(tokens), 512)
    for a, b in zip(kv.export(cache).values(), kv.export(back).values()):
        assert a.shape[2] == len(ids) and torch.equal(a, b)


def test_recompute_is_chosen_when_it_is_estimated_faster(harness, tmp_path, one_session):
    # 6 blocks: "s" (4 blocks) and "other" (a shorter prompt: 3) do not fit together
    h = harness(budget=one_session * 6 // 7, tiers={"disk": disk_tier(tmp_path)})
    reference = harness()

    async def play():
        messages = conversation_start(3)
        await chat(h, "s", messages, reference, "Name a fruit.")
        await chat(h, "other", conversation_start(5), reference, "Hi")  # evicts "s" to disk
        h.cache.costs.prefill_tps = 1e12  # as if prefill were all but free
        h.cache.costs.bandwidth["disk"] = 1.0
        h.committed["s"] = []
        final = await chat(h, "s", messages, reference, "And a vegetable?")
        assert final.miss_reason == "recompute_faster" and final.cached_tokens == 0

    asyncio.run(play())


def test_resident_sessions_are_persisted_periodically_in_bounded_steps(harness, tmp_path):
    reference = harness()

    async def play(h):
        for i in range(3):
            await chat(h, f"s{i}", conversation_start(i + 1), reference, "Hi")

    tier = disk_tier(tmp_path / "a")
    h = harness(tiers={"disk": tier})
    asyncio.run(play(h))
    assert len(tier.store) == 0  # not before the interval (60 s)
    h.cache.config.persist_every_s = 0.05  # the engine loop now sweeps while it idles
    deadline = time.monotonic() + 20
    while len(tier.store) < 3:
        assert time.monotonic() < deadline, "resident sessions were never written"
        time.sleep(0.05)
    tier.flush()
    assert len(list((tmp_path / "a").glob("*.kv"))) == 3
    assert [s.tier for s in h.cache.list_sessions("alice")] == ["device"] * 3  # still resident

    # one sweep copies at most max_bytes per call and goes on at the next call
    h = harness(tiers={"disk": disk_tier(tmp_path / "b")})
    asyncio.run(play(h))
    h.stop()  # no engine loop: the calls below are the only ones
    h.cache.config.persist_every_s = 0
    assert [h.cache.persist(max_bytes=1) for _ in range(4)] == [1, 1, 1, 0]


def test_fp8_sessions_park_quantized_and_a_tier_of_another_kv_dtype_is_recomputed(harness, tmp_path, loaded):
    """--kv-cache-dtype fp8: sessions go to disk as stored (one byte a value, with their
    scales; the file header says fp8) and come back identical to fp8 fresh prefills; a restart
    with another --kv-cache-dtype deletes those files at start and recomputes, never reads fp8
    bytes as its own format."""
    metrics = Metrics()
    budget = kv.bytes_for(loaded.model.config, 7 * kv.BLOCK_SIZE, loaded.dtype, "fp8")
    tier = disk_tier(tmp_path, metrics, kv_dtype="fp8")
    h = harness(budget=budget, tiers={"disk": tier}, metrics=metrics, kv_dtype="fp8")
    reference = harness(kv_dtype="fp8")
    convs = {sid: conversation_start(k) for k, sid in [(1, "a"), (2, "b")]}

    async def play(engine, expect_restore):
        for turn in range(2):
            for sid, messages in convs.items():
                final = await chat(engine, sid, messages, reference, f"Question {turn}?")
                if expect_restore and turn > 0:
                    assert final.miss_reason == "restored_disk" and final.cached_tokens > 0, sid

    asyncio.run(play(h, True))
    tier.flush()
    [path, *_] = sorted(tmp_path.glob("*.kv"))
    header = disk.read_header(path)
    assert header.kv_dtype == "fp8"
    _, tensors = disk.read(path, header)
    assert tensors["k.0"].dtype == torch.float8_e4m3fn and tensors["k_scale.0"].dtype == torch.bfloat16
    h.stop()
    with pytest.raises(disk.BadFile, match="fp8"):
        disk.read(path, disk.Header(header.fingerprint, header.principal, header.session_id, header.n_tokens, "auto"))
    plain = disk_tier(tmp_path, metrics, kv_dtype="auto")  # a restart with --kv-cache-dtype auto
    assert len(plain.store) == 0 and not list(tmp_path.glob("*.kv"))
    assert sample(metrics, "kvserve_kv_restore_failures_total", tier="disk", reason="foreign") >= 2
