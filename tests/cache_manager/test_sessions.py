"""SessionStore bookkeeping with hand-built token lists and a fake clock: exact results."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest

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

ALICE = Principal("alice")
BOB = Principal("bob")


def key(name: str, principal: Principal = ALICE) -> SessionKey:
    return (principal, SessionId(name))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Handle:
    """Stands in for the tensor module's KV handle."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Handle({self.name})"


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def drops():
    return []


@pytest.fixture
def store(clock, drops):
    return SessionStore(
        budget_bytes=100,
        ttl_s=60.0,
        clock=clock,
        on_drop=lambda entry, reason: drops.append((entry.key[1], reason)),
    )


def add(store: SessionStore, k: SessionKey, tokens=(1, 2, 3), nbytes=10) -> Entry:
    return store.put(Entry(k, list(tokens), Handle(k[1]), nbytes))


def names(entries) -> list[str]:
    return [e.key[1] for e in entries]


# -- construction and basics -------------------------------------------------------


def test_constructor_validates():
    with pytest.raises(ValueError):
        SessionStore(budget_bytes=-1, ttl_s=1.0)
    with pytest.raises(ValueError):
        SessionStore(budget_bytes=1, ttl_s=0.0)


def test_put_get_and_accounting(store, clock):
    assert len(store) == 0 and store.used_bytes == 0 and store.budget_bytes == 100
    stored = add(store, key("a"), tokens=[1, 2], nbytes=30)
    assert stored.last_used == 1000.0 and stored.pins == 0
    got = store.get(key("a"))
    assert got is stored
    assert got.tokens == [1, 2] and got.nbytes == 30 and got.principal == ALICE
    assert len(store) == 1 and store.used_bytes == 30 and store.free_bytes == 70
    assert store.get(key("missing")) is None
    assert store.get(key("a", BOB)) is None


def test_put_copies_tokens(store):
    tokens = [1, 2, 3]
    store.put(Entry(key("a"), tokens, Handle("a"), 1))
    tokens.append(4)
    assert store.get(key("a")).tokens == [1, 2, 3]


def test_entries_are_frozen(store):
    entry = add(store, key("a"))
    with pytest.raises(AttributeError):
        entry.pins = 5  # type: ignore[misc]


def test_put_rejects_pinned_or_negative_entries(store):
    with pytest.raises(ValueError):
        store.put(Entry(key("a"), [1], Handle("a"), 1, pins=1))
    with pytest.raises(ValueError):
        store.put(Entry(key("a"), [1], Handle("a"), -1))


def test_replace_with_other_handle_drops_old_and_keeps_pins(store, drops):
    add(store, key("a"), nbytes=30)
    store.pin(key("a"))
    new = store.put(Entry(key("a"), [9], Handle("a2"), 50))
    assert drops == [("a", "replaced")]
    assert new.pins == 1 and new.tokens == [9]
    assert store.used_bytes == 50 and len(store) == 1
    assert store.drop_counts["replaced"] == 1


def test_replace_with_same_handle_drops_nothing(store, drops):
    first = add(store, key("a"), nbytes=30)
    store.put(Entry(key("a"), [1, 2, 3, 4], first.kv, 40))
    assert drops == []
    assert store.used_bytes == 40


def test_update_commits_tokens_handle_and_size(store, drops, clock):
    first = add(store, key("a"), tokens=[1, 2], nbytes=20)
    add(store, key("b"), nbytes=5)
    clock.now += 1
    updated = store.update(key("a"), [1, 2, 3, 4], first.kv, 20)
    assert drops == []
    assert updated.tokens == [1, 2, 3, 4] and updated.last_used == 1001.0
    assert store.used_bytes == 25
    grown = store.update(key("a"), [1, 2, 3, 4, 5], Handle("a-grown"), 64)
    assert drops == [("a", "replaced")]
    assert store.used_bytes == 69
    assert store.get(key("a")) is grown
    with pytest.raises(KeyError):
        store.update(key("missing"), [1], Handle("x"), 1)


def test_update_passes_the_old_state_to_on_drop(clock):
    seen = []
    s = SessionStore(100, 60.0, clock=clock, on_drop=lambda e, r: seen.append((e, r)))
    old_kv = Handle("old")
    s.put(Entry(key("a"), [1, 2], old_kv, 10))
    s.update(key("a"), [1, 2, 3], Handle("new"), 20)
    (entry, reason), = seen
    assert reason == "replaced"
    assert entry.kv is old_kv and entry.tokens == [1, 2] and entry.nbytes == 10


def test_delete(store, drops):
    add(store, key("a"), nbytes=30)
    add(store, key("b"), nbytes=20)
    assert store.delete(key("a")) is True
    assert drops == [("a", "deleted")]
    assert store.used_bytes == 20 and len(store) == 1
    assert store.delete(key("a")) is False
    assert store.drop_counts == {"evicted": 0, "expired": 0, "deleted": 1, "replaced": 0}


def test_delete_of_pinned_entry_is_refused(store, drops):
    add(store, key("a"))
    store.pin(key("a"))
    with pytest.raises(EntryPinnedError):
        store.delete(key("a"))
    assert drops == [] and store.get(key("a")) is not None
    store.unpin(key("a"))
    assert store.delete(key("a"))


# -- principals never see each other's entries ---------------------------------------


def test_same_session_id_under_two_principals_is_two_entries(store, drops):
    add(store, key("s", ALICE), tokens=[1, 2], nbytes=10)
    add(store, key("s", BOB), tokens=[7, 8], nbytes=20)
    assert store.get(key("s", ALICE)).tokens == [1, 2]
    assert store.get(key("s", BOB)).tokens == [7, 8]
    assert names(store.list(ALICE)) == ["s"] and store.list(ALICE)[0].principal == ALICE
    assert store.delete(key("s", BOB))
    assert store.get(key("s", ALICE)).tokens == [1, 2]
    assert drops == [("s", "deleted")]
    assert store.list(BOB) == []


def test_list_is_per_principal_most_recent_first(store, clock):
    add(store, key("a"))
    clock.now += 1
    add(store, key("x", BOB))
    clock.now += 1
    add(store, key("b"))
    clock.now += 1
    store.unpin(store.pin(key("a")).key)
    assert names(store.list(ALICE)) == ["a", "b"]
    assert [e.last_used for e in store.list(ALICE)] == [1003.0, 1002.0]
    assert names(store.list(BOB)) == ["x"]
    assert store.list(Principal("carol")) == []


# -- pins --------------------------------------------------------------------------


def test_pin_counts_nest_and_unpin_below_zero_fails(store):
    add(store, key("a"))
    assert store.pin(key("a")).pins == 1
    assert store.pin(key("a")).pins == 2
    assert store.unpin(key("a")).pins == 1
    assert not store.get(key("a")).idle
    assert store.unpin(key("a")).pins == 0
    assert store.get(key("a")).idle
    with pytest.raises(ValueError):
        store.unpin(key("a"))
    with pytest.raises(KeyError):
        store.pin(key("missing"))
    with pytest.raises(KeyError):
        store.unpin(key("missing"))


def test_unpin_touches_last_used(store, clock):
    add(store, key("a"))
    store.pin(key("a"))
    clock.now += 500
    assert store.unpin(key("a")).last_used == 1500.0


def test_get_does_not_touch(store, clock):
    add(store, key("a"))
    clock.now += 10
    store.get(key("a"))
    store.list(ALICE)
    store.best_prefix_match(ALICE, [1, 2])
    assert store.get(key("a")).last_used == 1000.0


# -- LRU eviction ------------------------------------------------------------------


def test_make_room_evicts_least_recently_used_first_in_exact_order(store, drops):
    for name in "abcd":
        add(store, key(name), nbytes=25)  # 100 of 100 bytes used
    store.unpin(store.pin(key("a")).key)  # a becomes most recently used: b, c, d, a
    assert store.can_allocate(40)
    assert store.make_room(40)
    assert drops == [("b", "evicted"), ("c", "evicted")]
    assert store.used_bytes == 50 and store.free_bytes == 50
    assert names(store.list(ALICE)) == ["a", "d"]
    assert store.drop_counts["evicted"] == 2


def test_eviction_order_counts_put_update_pin_unpin_as_use(store, drops):
    for name in "abcde":
        add(store, key(name), nbytes=20)
    store.update(key("a"), [1], store.get(key("a")).kv, 20)  # order b c d e a
    store.pin(key("b"))
    store.unpin(key("b"))  # c d e a b
    add(store, key("c"), nbytes=20)  # replaced by a new handle: d e a b c
    drops.clear()
    assert store.make_room(100)
    assert drops == [("d", "evicted"), ("e", "evicted"), ("a", "evicted"), ("b", "evicted"),
                     ("c", "evicted")]


def test_make_room_without_need_evicts_nothing(store, drops):
    add(store, key("a"), nbytes=50)
    assert store.make_room(50)
    assert drops == [] and store.used_bytes == 50


def test_pinned_entries_are_skipped_by_eviction(store, drops):
    for name in "abcd":
        add(store, key(name), nbytes=25)
    store.pin(key("a"))  # in flight, and also most recent now: b c d a
    store.pin(key("b"))
    assert store.make_room(30)
    assert drops == [("c", "evicted"), ("d", "evicted")]
    assert names(store.list(ALICE)) == ["b", "a"]


def test_make_room_impossible_evicts_nothing(store, drops):
    for name in "abcd":
        add(store, key(name), nbytes=25)
    store.pin(key("a"))
    store.pin(key("b"))
    assert not store.can_allocate(51)
    assert not store.make_room(51)
    assert drops == [] and len(store) == 4 and store.used_bytes == 100
    assert store.can_allocate(50)
    assert store.make_room(50)
    assert drops == [("c", "evicted"), ("d", "evicted")]


def test_make_room_larger_than_budget_fails(store, drops):
    add(store, key("a"), nbytes=10)
    assert not store.can_allocate(101)
    assert not store.make_room(101)
    assert drops == []
    assert store.can_allocate(100) and store.make_room(100)
    assert drops == [("a", "evicted")] and store.used_bytes == 0


def test_eviction_crosses_principals_only_through_the_budget(store, drops):
    add(store, key("a", ALICE), nbytes=60)
    add(store, key("b", BOB), nbytes=40)
    assert store.make_room(50)
    assert drops == [("a", "evicted")]
    assert names(store.list(BOB)) == ["b"]


def test_put_and_update_never_evict(store, drops):
    add(store, key("a"), nbytes=80)
    add(store, key("b"), nbytes=80)
    assert drops == [] and store.used_bytes == 160 and store.free_bytes == -60
    assert store.make_room(0)
    assert drops == [("a", "evicted")]


# -- TTL ---------------------------------------------------------------------------


def test_expire_drops_idle_entries_older_than_ttl(store, clock, drops):
    add(store, key("a"))
    clock.now += 30
    add(store, key("b"))
    clock.now += 30  # a is exactly ttl old: still fresh
    assert store.expire() == []
    clock.now += 0.5
    expired = store.expire()
    assert names(expired) == ["a"]
    assert drops == [("a", "expired")]
    assert names(store.list(ALICE)) == ["b"]
    assert store.used_bytes == 10 and store.drop_counts["expired"] == 1


def test_pinned_entries_never_expire(store, clock, drops):
    add(store, key("a"))
    add(store, key("b"))
    store.pin(key("a"))  # order b a
    clock.now += 1000
    assert names(store.expire()) == ["b"]
    assert store.get(key("a")) is not None
    store.unpin(key("a"))  # last_used = now
    clock.now += 60
    assert store.expire() == []
    clock.now += 1
    assert names(store.expire()) == ["a"]
    assert drops == [("b", "expired"), ("a", "expired")]


def test_lookups_expire(store, clock, drops):
    add(store, key("a"))
    clock.now += 61
    assert store.get(key("a")) is None
    assert drops == [("a", "expired")]


def test_make_room_expires_before_evicting(store, clock, drops):
    add(store, key("old"), nbytes=50)
    clock.now += 40
    add(store, key("new"), nbytes=50)
    clock.now += 21
    assert store.make_room(10)
    assert drops == [("old", "expired")]
    assert store.used_bytes == 50


# -- miss reasons ------------------------------------------------------------------


def test_lookup_miss_reason(store, clock):
    assert store.lookup_miss_reason(key("never")) == "new_session"
    for name in "abc":
        add(store, key(name), nbytes=50)  # a is evicted by the budget check below
    assert store.make_room(0)
    assert store.lookup_miss_reason(key("a")) == "evicted"
    clock.now += 61
    assert store.get(key("b")) is None
    assert store.lookup_miss_reason(key("b")) == "expired"
    assert store.lookup_miss_reason(key("c")) == "expired"
    assert store.lookup_miss_reason(key("a", BOB)) == "new_session"


def test_miss_reason_is_forgotten_on_put_and_delete(store):
    add(store, key("a"), nbytes=100)
    assert store.make_room(1)
    assert store.lookup_miss_reason(key("a")) == "evicted"
    add(store, key("a"), nbytes=10)
    assert store.delete(key("a"))
    assert store.lookup_miss_reason(key("a")) == "new_session"


def test_miss_reason_memory_is_bounded(clock):
    s = SessionStore(budget_bytes=1, ttl_s=60.0, clock=clock, remember_dropped=2)
    for name in "abc":
        s.put(Entry(key(name), [1], Handle(name), 1))
        assert s.make_room(1)  # evicts the one just put
    assert [s.lookup_miss_reason(key(n)) for n in "abc"] == ["new_session", "evicted", "evicted"]


# -- best prefix match -------------------------------------------------------------


def test_best_prefix_match_picks_the_longest_common_prefix(store):
    add(store, key("short"), tokens=[1, 2, 9])
    add(store, key("long"), tokens=[1, 2, 3, 4, 8])
    add(store, key("other"), tokens=[5, 6])
    assert store.best_prefix_match(ALICE, [1, 2, 3, 4, 5]) == (key("long"), 4)
    assert store.best_prefix_match(ALICE, [1, 2, 9, 9]) == (key("short"), 3)
    assert store.best_prefix_match(ALICE, [5, 6, 7]) == (key("other"), 2)
    assert store.best_prefix_match(ALICE, [7]) is None
    assert store.best_prefix_match(ALICE, []) is None


def test_best_prefix_match_ties_go_to_most_recently_used(store):
    add(store, key("x"), tokens=[1, 2, 3])
    add(store, key("y"), tokens=[1, 2, 4])
    assert store.best_prefix_match(ALICE, [1, 2, 5]) == (key("y"), 2)
    store.unpin(store.pin(key("x")).key)
    assert store.best_prefix_match(ALICE, [1, 2, 5]) == (key("x"), 2)


def test_best_prefix_match_never_crosses_principals(store):
    add(store, key("bobs", BOB), tokens=[1, 2, 3, 4, 5, 6])
    add(store, key("alices", ALICE), tokens=[1, 9])
    assert store.best_prefix_match(ALICE, [1, 2, 3, 4, 5, 6]) == (key("alices"), 1)
    assert store.best_prefix_match(BOB, [1, 9]) == (key("bobs", BOB), 1)
    assert store.best_prefix_match(Principal("carol"), [1, 2, 3]) is None


def test_best_prefix_match_skips_pinned_unless_asked(store):
    add(store, key("busy"), tokens=[1, 2, 3, 4])
    add(store, key("idle"), tokens=[1, 2])
    store.pin(key("busy"))
    assert store.best_prefix_match(ALICE, [1, 2, 3, 4]) == (key("idle"), 2)
    assert store.best_prefix_match(ALICE, [1, 2, 3, 4], idle_only=False) == (key("busy"), 4)


def test_best_prefix_match_anonymous_only(store):
    anon = anonymous_session_id()
    add(store, key("named"), tokens=[1, 2, 3, 4])
    add(store, (ALICE, anon), tokens=[1, 2])
    assert store.best_prefix_match(ALICE, [1, 2, 3]) == (key("named"), 3)
    assert store.best_prefix_match(ALICE, [1, 2, 3], anonymous_only=True) == ((ALICE, anon), 2)


def test_best_prefix_match_ignores_expired(store, clock):
    add(store, key("a"), tokens=[1, 2, 3])
    clock.now += 61
    assert store.best_prefix_match(ALICE, [1, 2, 3]) is None


def test_anonymous_ids():
    a, b = anonymous_session_id(), anonymous_session_id()
    assert a != b
    assert is_anonymous(a) and a.startswith("anon-") and len(a) == len("anon-") + 32
    assert not is_anonymous("chat-42")


# -- callbacks and threads ---------------------------------------------------------


def test_on_drop_may_call_back_into_the_store(clock):
    # on_drop runs outside the lock: the owner may query the store while freeing.
    seen = []
    s = SessionStore(10, 60.0, clock=clock)
    s._on_drop = lambda e, r: seen.append((e.key[1], r, len(s), s.get(e.key)))
    s.put(Entry(key("a"), [1], Handle("a"), 10))
    assert s.make_room(5)
    assert seen == [("a", "evicted", 0, None)]


def test_admin_thread_list_and_delete_while_engine_mutates():
    s = SessionStore(budget_bytes=10**9, ttl_s=60.0)
    stop = threading.Event()
    errors = []

    def engine():
        i = 0
        try:
            while not stop.is_set():
                k = key(f"s{i % 50}")
                s.put(Entry(k, [i], Handle("h"), 1))
                try:
                    s.pin(k)
                except KeyError:  # deleted by the admin between put and pin
                    continue
                s.update(k, [i, i + 1], Handle("g"), 2)
                s.unpin(k)
                i += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def admin():
        try:
            for _ in range(300):
                for entry in s.list(ALICE):
                    try:
                        s.delete(entry.key)
                    except EntryPinnedError:
                        pass
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=engine)
    t.start()
    try:
        admin()
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert s.used_bytes == sum(e.nbytes for e in s.list(ALICE))


def test_bookkeeping_imports_no_torch():
    code = (
        "import sys, cache_manager.sessions, cache_manager.prefix; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_put_pinned_inserts_an_entry_no_other_thread_can_delete(store):
    stored = store.put(Entry(key("new"), [], Handle("new"), 10), pinned=True)
    assert stored.pins == 1 and not stored.idle
    with pytest.raises(EntryPinnedError):
        store.delete(key("new"))
    assert store.unpin(key("new")).pins == 0
    assert store.delete(key("new"))
