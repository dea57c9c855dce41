"""The response store's bookkeeping (no model): budget, LRU order, owners, disk round trip."""

from __future__ import annotations

from server.api.response_store import ResponseStore, StoredResponse


def record(n: int, principal: str = "p", pad: int = 0) -> StoredResponse:
    rid = f"resp_{n:032x}"
    return StoredResponse(rid, principal, f"resp_{0:032x}", {"id": rid, "pad": "x" * pad}, [{"id": f"msg_{n}"}], [{"id": f"msg_{n}"}])


def size(n: int, pad: int = 0) -> int:
    return len(record(n, pad=pad).to_json())


def test_least_recently_used_is_evicted_first_and_a_use_counts():
    one = size(1)
    store = ResponseStore(3 * one)
    for n in (1, 2, 3):
        assert store.put(record(n))
    assert store.get("p", record(1).id) is not None  # 1 is now the most recently used
    assert store.put(record(4))
    assert [n for n in (1, 2, 3, 4) if store.get("p", record(n).id)] == [1, 3, 4]
    assert store.evictions == {"evicted": 1, "deleted": 0}
    assert store.nbytes == 3 * one


def test_too_large_is_not_stored_and_others_stay():
    store = ResponseStore(2 * size(1))
    assert store.put(record(1))
    assert not store.put(record(2, pad=10 * size(1)))
    assert store.get("p", record(2).id) is None and store.get("p", record(1).id) is not None
    assert ResponseStore(0).put(record(1)) is False


def test_only_the_owner_gets_or_deletes():
    store = ResponseStore(10 * size(1))
    store.put(record(1, principal="a"))
    assert store.get("b", record(1).id) is None
    assert store.delete("b", record(1).id) is None
    assert store.get("a", record(1).id) is not None
    assert store.sessions_in_use("a", record(1).session_id) == 1
    assert store.delete("a", record(1).id) is not None
    assert store.get("a", record(1).id) is None and store.nbytes == 0
    assert store.sessions_in_use("a", record(1).session_id) == 0
    assert (store.hits, store.misses) == (1, 2)


def test_disk_round_trip_applies_the_budget_and_drops_bad_files(tmp_path):
    store = ResponseStore(10 * size(1), tmp_path)
    store.load()
    for n in (1, 2, 3):
        store.put(record(n))
    store.delete("p", record(2).id)
    store.flush()
    (tmp_path / f"resp_{9:032x}.json").write_text("{not json")
    (tmp_path / "x.123.tmp").write_text("cut short")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"resp_{1:032x}.json", f"resp_{3:032x}.json", f"resp_{9:032x}.json", "x.123.tmp"])
    store.close()

    again = ResponseStore(size(1), tmp_path)  # room for one: the newest file is kept
    assert again.load() == 1
    assert again.get("p", record(3).id).response == record(3).response
    again.flush()
    assert [p.name for p in tmp_path.iterdir()] == [f"resp_{3:032x}.json"]
