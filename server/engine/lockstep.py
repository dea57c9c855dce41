"""The ranks of a tensor-parallel model in step (server/parallel.py).

Rank 0's runner (`ModelRunner`) owns the pool's bookkeeping: which blocks a sequence holds and
how long it is. Each forward it runs is sent first (`Leader.step`) to the other ranks in one
broadcast on the control group: per row its block table, length and new tokens' count, and the
tokens. A follower (`follow`) runs the same forward over rows it builds from them in its own
pool, which holds its share of every block's KV heads; the collectives inside the forward meet
there. Only rank 0 reads logits.

A follower's pool zeroes a block the first time a step names it, as rank 0's zeroes a block the
first time it hands it out (`kv.Pool.touch`). The tiers below the device reach every rank's
pool through rank 0's (`kv.Pool.peers`): a session's KV leaves with every rank's heads gathered
in rank order (`gather`) and comes back split, each rank writing its own (`scatter`), within
one call on rank 0: complete on every rank or on none. Nothing else writes a pool: hybrid state
and anything else that would is refused with tensor parallel (server/settings.py,
server/sharding.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from cache_manager import kv
from server import memory

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # an idle leader's broadcast, so that a follower's wait has a time-out
STATS_S = 5.0  # how often the engine reports every rank's figures (`Leader.stats`; one process: its own)


class RankLost(RuntimeError):
    """Another rank is gone or stopped answering: the engine cannot run."""


class Leader:
    """Rank 0's side: every forward and the heartbeat go out on `group` (the control group);
    `lost` says which started rank has exited, where this process started them."""

    def __init__(self, group, size: int, lost: Callable[[], str | None] = lambda: None) -> None:
        self.group = group
        self.size = size  # ranks
        self._lost = lost
        self._sent = time.monotonic()
        # why a collective failed: every later call raises at once (a failure can leave the ranks
        # out of step, so none is ever started again)
        self._broken: str | None = None

    def stats(self, mine: dict) -> list[dict]:
        """Every rank's `Figures.take`, in rank order (`mine`: rank 0's)."""
        import torch.distributed as dist

        self._send(("stats",))
        every: list[dict | None] = [None] * self.size
        self._collective(dist.gather_object, mine, every, dst=0, group=self.group)
        return every

    def gather(self, cache: kv.SequenceKV, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`kv.export` of `cache` on every rank (`mine`: rank 0's), joined along the heads, on
        the CPU."""
        import torch.distributed as dist

        mine = kv.to_cpu(mine, copy=False)  # before the followers are told: nothing may fail between
        self._send(("export", cache.blocks, cache.length))
        every: list[dict | None] = [None] * self.size
        self._collective(dist.gather_object, mine, every, dst=0, group=self.group)
        return {name: torch.cat([tensors[name] for tensors in every], dim=1) for name in mine}

    def scatter(self, cache: kv.SequenceKV, tensors: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        """Every rank's heads of `tensors` (`kv.load`'s, all heads) to it, written into its pool
        at `cache`'s blocks; returns rank 0's."""
        import torch.distributed as dist

        parts = [{} for _ in range(self.size)]
        for name, t in tensors.items():
            for rank, piece in enumerate(t.chunk(self.size, dim=1)):
                parts[rank][name] = piece.contiguous()
        self._send(("load", cache.blocks, length))
        out: list[dict | None] = [None]
        self._collective(dist.scatter_object_list, out, parts, src=0, group=self.group)
        return out[0]

    def step(self, rows, token_ids: list[int], logits_rows: list[int], counts: list[int] | None, long_rows: list[bool] | None) -> None:
        """Send a forward of `rows` (attention Rows of rank 0's caches) before rank 0 runs it."""
        self._send(("step", [(r.kv.blocks, r.kv.length, r.n) for r in rows], token_ids, logits_rows, counts, long_rows))

    def heartbeat(self) -> None:
        """Between steps: tell the followers the leader is alive, at most every HEARTBEAT_S."""
        if time.monotonic() - self._sent >= HEARTBEAT_S:
            self._send(("beat",))

    def stop(self) -> None:
        """The followers end (the engine stopped)."""
        try:
            self._send(("stop",))
        except RankLost as exc:
            log.warning("could not stop the other ranks: %s", exc)

    def lost(self, exc: BaseException | None = None) -> str | None:
        """Why the engine cannot run, where a rank is gone (`exc`: what a step raised), else None."""
        import torch.distributed as dist

        why = self._lost()
        if why is not None:
            return why
        if isinstance(exc, RankLost):
            return str(exc)
        if isinstance(exc, dist.DistError):
            return f"a collective between the ranks failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return None

    def _send(self, message: tuple) -> None:
        import torch.distributed as dist

        self._collective(dist.broadcast_object_list, [message], src=0, group=self.group)
        self._sent = time.monotonic()

    def _collective(self, fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) on the control group; RankLost when it fails, and from then on."""
        if self._broken is not None:
            raise RankLost(self._broken)
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._broken = self._lost() or f"the other ranks stopped answering ({type(exc).__name__}: {exc})"
            raise RankLost(self._broken) from exc


def follow(runner, group) -> None:
    """A follower's loop: run each forward rank 0 sends, over this rank's pool, until it sends
    "stop". Raises (the process ends) when rank 0 is gone or stops answering, or a forward
    fails here (rank 0's engine then dies: the ranks could not be kept in step after it)."""
    import torch.distributed as dist

    from server.engine.context import Row

    pool, figures = runner.pool, Figures()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        kind, *args = box[0]
        if kind == "stop":
            return
        if kind == "beat":
            continue
        if kind == "stats":
            dist.gather_object(figures.take(), None, dst=0, group=group)
            continue
        if kind == "export":  # this rank's heads of a session leaving for a tier
            blocks, length = args
            dist.gather_object(kv.to_cpu(kv.export(_cache(pool, blocks, length)), copy=False), None, dst=0, group=group)
            continue
        if kind == "load":  # ... and coming back
            blocks, length = args
            out: list[dict | None] = [None]
            dist.scatter_object_list(out, None, src=0, group=group)
            kv.put(_cache(pool, blocks, 0), out[0], length)
            continue
        specs, token_ids, logits_rows, counts, long_rows = args
        rows = [Row(_cache(pool, blocks, length), n) for blocks, length, n in specs]
        t0 = time.perf_counter()
        runner.forward(rows, token_ids, logits_rows, counts, long_rows)  # a failure ends this rank, and the engine
        figures.ran(time.perf_counter() - t0)


class Figures:
    """A rank's forwards since it was last asked, and its memory in use (`take`)."""

    def __init__(self) -> None:
        self.seconds, self.forwards = 0.0, 0

    def ran(self, seconds: float) -> None:
        self.seconds += seconds
        self.forwards += 1

    def take(self) -> dict:
        """{"step_seconds": mean forward since the last take (None without one), "in_use":
        bytes}; starts over."""
        mean = self.seconds / self.forwards if self.forwards else None
        self.seconds, self.forwards = 0.0, 0
        in_use = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else memory.rss_bytes()
        return {"step_seconds": mean, "in_use": in_use}


def _cache(pool: kv.Pool, blocks: list[int], length: int) -> kv.SequenceKV:
    """Rank 0's block table and length of a sequence, over this rank's pool."""
    pool.touch(blocks)
    cache = kv.SequenceKV(pool)
    cache._set_blocks(blocks)
    cache.length = length
    return cache
