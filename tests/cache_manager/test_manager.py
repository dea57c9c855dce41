"""CacheManager bookkeeping with hand-built prompts and a config-only model (no weights, no
forward pass): the races with admin DELETEs, pins released on failure, exact byte accounting
of growth, anonymous reuse in blocks."""

import pytest
import torch
from transformers import LlamaConfig

from cache_manager import kv
from cache_manager.manager import NO_SESSION, CacheConfig, CacheManager, NoRoom
from cache_manager.sessions import EntryPinnedError, is_anonymous

CPU = torch.device("cpu")
# 2 layers x 1 KV head x head_dim 4, fp32: 2 (K, V) x 2 x 1 x 4 x 4 B = 64 bytes per position
CONFIG = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
S256 = 256 * 64
BLOCK = kv.BLOCK_SIZE * 64  # one block of the pool


def manager(budget=20 * S256, **config) -> CacheManager:
    return CacheManager(CONFIG, CPU, torch.float32, 2048, CacheConfig(budget_bytes=budget, **config))


def written(lease, tokens):
    """Stands in for the engine's forward pass: the cache now holds `tokens`."""
    lease.cache.length = len(tokens)
    return tokens


def turn(m, session, prompt, capacity=None, principal="alice"):
    """acquire, 'run' (prompt + 2 generated tokens) and commit; returns the lease."""
    lease = m.acquire(principal, session, prompt, capacity or len(prompt) + 2)
    m.commit(lease, written(lease, prompt + [1, 2]))
    return lease


def pinned(m):
    return [e.session_id for e in m.store.list("alice") if not e.idle]


def test_bytes_per_position():
    assert kv.bytes_for(CONFIG, 256, torch.float32) == S256


# -- item 12: admin DELETE races and pins released in `finally` --------------------------


def test_delete_between_get_and_pin_is_a_clean_miss(monkeypatch):
    m = manager()
    turn(m, "s", list(range(10, 40)))
    get = m.store.get

    def get_then_admin_delete(key):
        entry = get(key)
        assert m.delete_session("alice", "s")  # the event loop thread wins the race here
        return entry

    monkeypatch.setattr(m.store, "get", get_then_admin_delete)
    lease = m.acquire("alice", "s", list(range(10, 45)), 64)
    monkeypatch.undo()
    assert (lease.n_reused, lease.miss_reason, lease.base_tokens) == (0, "new_session", [])
    assert pinned(m) == ["s"]
    m.commit(lease, written(lease, list(range(10, 47))))
    assert pinned(m) == [] and m.store.get(("alice", "s")).tokens == list(range(10, 47))


def test_a_new_entry_is_pinned_from_the_start():
    m = manager()
    lease = m.acquire("alice", "s", [5, 6, 7], 8)
    with pytest.raises(EntryPinnedError):  # no window between insert and pin
        m.delete_session("alice", "s")
    m.release(lease)
    assert len(m.store) == 0 and m.store.used_bytes == 0


def test_release_rolls_back_while_pinned_and_an_admin_delete_after_it_is_clean(monkeypatch):
    m = manager()
    first = turn(m, "s", list(range(10, 40)))
    lease = m.acquire("alice", "s", list(range(10, 40)) + [1, 2, 50, 51], 64)
    assert lease.n_reused == 32 and first.cache is lease.cache
    written(lease, list(range(10, 40)) + [1, 2, 50, 51, 52])  # the aborted request wrote more
    update, unpin = m.store.update, m.store.unpin
    seen = []

    def update_with_admin_delete(*args):
        with pytest.raises(EntryPinnedError):  # still pinned while the rollback is recorded
            m.delete_session("alice", "s")
        seen.append("update")
        return update(*args)

    def unpin_then_admin_delete(key):
        entry = unpin(key)
        seen.append("deleted" if m.delete_session("alice", "s") else "missing")
        return entry

    monkeypatch.setattr(m.store, "update", update_with_admin_delete)
    monkeypatch.setattr(m.store, "unpin", unpin_then_admin_delete)
    m.release(lease)  # no KeyError
    assert seen == ["update", "deleted"]
    assert len(m.store) == 0 and m.store.used_bytes == 0


def test_release_that_drops_tolerates_an_admin_delete_first(monkeypatch):
    m = manager()
    lease = m.acquire("alice", "s", [5, 6, 7], 8)  # a miss: release drops the entry
    unpin = m.store.unpin

    def unpin_then_admin_delete(key):
        entry = unpin(key)
        assert m.delete_session("alice", "s")
        return entry

    monkeypatch.setattr(m.store, "unpin", unpin_then_admin_delete)
    m.release(lease)
    assert len(m.store) == 0


def test_a_failing_commit_unpins_and_drops_the_entry(monkeypatch):
    m = manager()
    lease = m.acquire("alice", "s", [5, 6, 7], 8)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(m.store, "update", broken)
    with pytest.raises(RuntimeError):
        m.commit(lease, written(lease, [5, 6, 7, 8]))
    monkeypatch.undo()
    assert len(m.store) == 0 and m.store.used_bytes == 0  # not pinned forever, not half-recorded


def test_a_failing_release_unpins_and_drops_the_entry(monkeypatch):
    m = manager()
    turn(m, "s", list(range(10, 40)))
    lease = m.acquire("alice", "s", list(range(10, 40)) + [1, 2, 50], 64)
    assert lease.n_reused == 32

    def broken(cache, n):
        raise RuntimeError("boom")

    monkeypatch.setattr(kv, "crop", broken)
    with pytest.raises(RuntimeError):
        m.release(lease)
    assert len(m.store) == 0 and m.store.used_bytes == 0


def test_a_failing_acquire_leaves_the_session_unpinned_and_usable():
    m = manager(budget=10 * BLOCK)
    turn(m, "s", list(range(10, 40)))
    with pytest.raises(NoRoom):  # 400 positions are 25 blocks
        m.acquire("alice", "s", list(range(10, 40)) + [1, 2] + [7] * 300, 400)
    entry = m.store.get(("alice", "s"))
    assert entry.idle and entry.tokens == list(range(10, 40)) + [1, 2] and entry.nbytes == 2 * BLOCK
    lease = m.acquire("alice", "s", list(range(10, 40)) + [1, 2, 3], 50)
    assert lease.n_reused == 32


# -- the pool: growth appends blocks, commit gives back the unused tail ---------------------


def test_commit_keeps_only_the_blocks_the_tokens_use():
    m = manager()
    lease = m.acquire("alice", "a", list(range(10, 40)), 400)
    assert kv.capacity(lease.cache) == 400 and m.store.used_bytes == 25 * BLOCK
    m.commit(lease, written(lease, list(range(10, 40)) + [1, 2, 3]))  # 33 tokens: 3 blocks
    assert m.store.used_bytes == 3 * BLOCK and kv.capacity(lease.cache) == 48
    assert m.pool.allocator.num_free == m.pool.num_blocks - 3


def test_grow_appends_blocks_in_place_and_counts_only_the_difference():
    m = manager(budget=25 * BLOCK)
    first = turn(m, "a", list(range(10, 40)))
    assert m.store.used_bytes == 2 * BLOCK
    lease = m.acquire("alice", "a", list(range(10, 40)) + [1, 2] + [7] * 300, 400)
    assert lease.cache is first.cache and lease.n_reused == 32  # the same blocks, nothing copied
    assert kv.capacity(lease.cache) == 400 and m.store.used_bytes == 25 * BLOCK
    assert lease.cache.blocks == list(range(25)) and lease.cache.base == 0  # appended after its last


def test_grow_evicts_for_the_difference_only():
    m = manager(budget=26 * BLOCK)
    turn(m, "a", list(range(10, 40)))
    turn(m, "b", list(range(50, 80)))
    assert m.store.used_bytes == 4 * BLOCK
    # a grows by 23 blocks: 4 + 23 > 26, so b (2 blocks) must go first
    lease = m.acquire("alice", "a", list(range(10, 40)) + [1, 2] + [7] * 300, 400)
    assert [e.session_id for e in m.store.list("alice")] == ["a"]
    assert m.store.drop_counts["evicted"] == 1 and m.store.used_bytes == 25 * BLOCK
    m.commit(lease, written(lease, list(range(10, 40)) + [1, 2] + [7] * 300))
    assert m.store.used_bytes == 21 * BLOCK and pinned(m) == []  # 332 tokens: 21 blocks
    assert m.pool.allocator.num_free == m.pool.num_blocks - 21


def test_grow_that_does_not_fit_is_refused_and_changes_nothing():
    m = manager(budget=20 * BLOCK)
    turn(m, "a", list(range(10, 40)))
    with pytest.raises(NoRoom):
        m.acquire("alice", "a", list(range(10, 40)) + [1, 2] + [7] * 300, 400)
    assert m.store.used_bytes == 2 * BLOCK and pinned(m) == []
    assert m.pool.allocator.num_free == m.pool.num_blocks - 2


def test_evicted_and_deleted_sessions_give_their_blocks_back():
    m = manager(budget=4 * BLOCK)
    turn(m, "a", list(range(10, 40)))
    turn(m, "b", list(range(50, 80)))
    turn(m, "c", list(range(90, 120)))  # evicts a
    assert m.store.drop_counts["evicted"] == 1 and m.pool.allocator.num_free == 0
    assert m.delete_session("alice", "b") and m.pool.allocator.num_free == 2


# -- item 6: anonymous reuse off, or in blocks --------------------------------------------


def test_without_anonymous_reuse_a_request_without_a_session_is_private():
    m = manager(anonymous_reuse=False)
    lease = m.acquire("anonymous", None, [5, 6, 7], 8)
    assert (lease.key, lease.n_reused, lease.miss_reason) == (None, 0, NO_SESSION)
    assert len(m.store) == 0
    m.commit(lease, [5, 6, 7, 8])
    again = m.acquire("anonymous", None, [5, 6, 7], 8)
    assert again.n_reused == 0 and len(m.store) == 0
    m.release(again)
    turn(m, "mine", list(range(10, 40)), principal="anonymous")  # named sessions still reuse
    assert m.acquire("anonymous", "mine", list(range(10, 40)) + [1, 2, 3], 64).n_reused == 32


def test_anonymous_reuse_reports_whole_blocks_and_named_sessions_exact_counts():
    m = manager()
    secret = list(range(10, 110))  # 100 tokens
    turn(m, None, secret)
    (anon,) = [e.session_id for e in m.store.list("alice")]
    assert is_anonymous(anon)
    for matching in (70, 80, 95):  # guesses agreeing on 70, 80 or 95 leading tokens
        guess = secret[:matching] + [3] * 10
        lease = m.acquire("alice", None, guess, 120)
        assert lease.n_reused == 64 and lease.key == ("alice", anon), matching
        m.release(lease)  # rolls back to the 64 reused tokens ...
        turn(m, None, secret)  # ... and the secret's next turn puts the rest back
    # fewer than one block in common: a new entry, the other one untouched
    lease = m.acquire("alice", None, secret[:31] + [3] * 10, 64)
    assert lease.n_reused == 0 and lease.key[1] != anon and lease.miss_reason == "new_session"
    m.release(lease)
    # a prompt extending the whole entry reuses (and reports) all of it
    whole = m.store.get(("alice", anon)).tokens
    lease = m.acquire("alice", None, whole + [4, 5], 120)
    assert lease.n_reused == len(whole) == 102
    m.release(lease)
    # a named session is the caller's own history: exact counts
    turn(m, "mine", secret)
    assert m.acquire("alice", "mine", secret[:70] + [3] * 10, 120).n_reused == 70
