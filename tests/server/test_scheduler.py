"""The step scheduler with hand-built sequences and no model: exact rows and token counts."""

from dataclasses import dataclass

import pytest

from server.engine.scheduler import Scheduler
from server.engine.sequence import Status


@dataclass
class Seq:
    name: str
    status: Status
    num_pending: int
    session_key: str | None = None

    whole: tuple[int, int] | None = None  # a (start, end) of pending tokens a chunk must not end inside

    @property
    def chunk_limit(self) -> int:
        return self.num_pending

    def fit(self, n: int) -> int:
        if self.whole is not None and self.whole[0] < n < self.whole[1]:
            return self.whole[0] or self.whole[1]
        return n


def decode(name, pending=1):
    return Seq(name, Status.DECODE, pending)


def prefill(name, pending):
    return Seq(name, Status.PREFILL, pending)


def rows(plan):
    return [(r.seq.name, r.n_tokens, r.completes) for r in plan.rows]


def test_alone_a_prompt_prefills_in_one_pass_whatever_the_budget():
    assert rows(Scheduler(16).schedule([prefill("a", 1500)])) == [("a", 1500, True)]


def test_alone_a_prompt_prefills_in_budget_chunks_on_the_paged_path():
    assert rows(Scheduler(512, chunk_alone=True).schedule([prefill("a", 1500)])) == [("a", 512, False)]


def test_decode_rows_first_then_prefill_chunks_fcfs_under_the_budget():
    running = [prefill("p1", 300), decode("d1"), prefill("p2", 100), decode("d2", 3), prefill("p3", 50)]
    plan = Scheduler(256).schedule(running)
    # 1 + 3 decode tokens, then 252 left: p1 takes 252 of its 300, p2 and p3 wait
    assert rows(plan) == [("d1", 1, True), ("d2", 3, True), ("p1", 252, False)]
    assert plan.num_tokens == 256


def test_prefills_share_what_is_left_in_arrival_order():
    running = [decode("d1"), prefill("p1", 100), prefill("p2", 100), prefill("p3", 100)]
    assert rows(Scheduler(251).schedule(running)) == [
        ("d1", 1, True), ("p1", 100, True), ("p2", 100, True), ("p3", 50, False),
    ]


def test_the_oldest_prompt_progresses_even_when_decode_rows_fill_the_budget():
    running = [decode(f"d{i}") for i in range(8)] + [prefill("p1", 40), prefill("p2", 40)]
    plan = Scheduler(8).schedule(running)
    assert rows(plan)[-1] == ("p1", 1, False)
    assert [name for name, _, _ in rows(plan)].count("p2") == 0


def test_a_prompt_advances_every_step_until_done():
    """No starvation: under a steady load of decode rows the prompt finishes its prefill."""
    p = prefill("p", 1000)
    running = [decode(f"d{i}") for i in range(4)] + [p]
    scheduler, steps = Scheduler(64), 0
    while p.num_pending:
        n = dict((name, k) for name, k, _ in rows(scheduler.schedule(running)))["p"]
        p.num_pending -= n
        steps += 1
    assert steps == -(-1000 // 60)


def test_nothing_pending_means_no_row():
    assert rows(Scheduler(8).schedule([decode("d", 0), prefill("p", 0)])) == []


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        Scheduler(0)


# -- admission: which waiting sequences start, their KV reserved ---------------------------


def waiting(*names_and_keys):
    return [Seq(name, Status.WAITING, 10, key) for name, key in names_and_keys]


class Pool:
    """A stand-in for the cache manager: `room` sequences fit; `broken` ones raise."""

    def __init__(self, room, broken=()):
        self.room, self.broken, self.reserved = room, set(broken), []

    def reserve(self, seq):
        if seq.name in self.broken:
            raise RuntimeError("a bug")
        if self.room == 0:
            return False
        self.room -= 1
        self.reserved.append(seq.name)
        return True


def names(seqs):
    return [s.name for s in seqs]


def test_admits_in_arrival_order_up_to_max_running():
    pool = Pool(room=10)
    out = Scheduler(512, max_running=3).admit(waiting(("a", None), ("b", None), ("c", None)), [decode("r")], pool.reserve)
    assert names(out.started) == ["a", "b"] and pool.reserved == ["a", "b"] and out.refused == []


def test_a_busy_session_waits_without_blocking_the_queue():
    running = [Seq("r", Status.DECODE, 1, "s1")]
    out = Scheduler(512).admit(waiting(("a", "s1"), ("b", "s2"), ("c", "s2"), ("d", None)), running, Pool(10).reserve)
    assert names(out.started) == ["b", "d"]  # a: s1 runs; c: s2 started just now


def test_no_room_blocks_the_queue_while_others_run_and_refuses_when_nothing_does():
    pool = Pool(room=1)
    out = Scheduler(512).admit(waiting(("a", None), ("b", None), ("c", None)), [], pool.reserve)
    assert names(out.started) == ["a"] and out.refused == []  # b waits for a; c waits behind b
    pool = Pool(room=0)
    out = Scheduler(512).admit(waiting(("a", None), ("b", None)), [], pool.reserve)
    assert out.started == [] and [(s.name, e) for s, e in out.refused] == [("a", "kv_budget"), ("b", "kv_budget")]


def test_a_failing_reservation_refuses_that_sequence_only():
    pool = Pool(room=5, broken={"b"})
    out = Scheduler(512).admit(waiting(("a", None), ("b", None), ("c", None)), [], pool.reserve)
    assert names(out.started) == ["a", "c"] and [(s.name, e) for s, e in out.refused] == [("b", "internal")]


def test_a_chunk_ends_outside_a_picture_computed_in_one_pass():
    """Gemma 3's picture attends to itself whole: a chunk that would end inside it stops at its
    start, and one that starts at it takes it whole, past the budget."""
    assert rows(Scheduler(8, chunk_alone=True).schedule([Seq("a", Status.PREFILL, 40, whole=(5, 20))])) == [("a", 5, False)]
    assert rows(Scheduler(8, chunk_alone=True).schedule([Seq("a", Status.PREFILL, 40, whole=(0, 20))])) == [("a", 20, False)]
