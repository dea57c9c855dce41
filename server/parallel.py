"""Tensor parallel: one model over `--tensor-parallel-size` ranks, one process per GPU (per
share of the cores on CPU), over torch.distributed.

Rank 0, the leader, serves HTTP and owns everything a request touches: the scheduler, the
sessions' bookkeeping, grammars and sampling. The other ranks, the followers, hold their shard
of the weights (transformers' tensor-parallel plan: server/sharding.py) and a KV pool of
their share of the KV heads (`kv.SHARDS`); each step's inputs reach them in one broadcast on a
gloo group (server/engine/lockstep.py), every rank runs the forward on its shard, and the
collectives inside it (NCCL on CUDA, gloo on CPU) join the shards.

How ranks start:

* `kvserve serve --tensor-parallel-size N` on one node: the process started is rank 0, and it
  starts ranks 1..N-1 as its child processes (`spawn`), which die with it (Linux's parent-death
  signal). Every rank but 0 ignores SIGINT and SIGTERM: rank 0 drains and then stops them.
* `--nnodes M`: every node runs the same command with its own `--node-rank`, and starts its
  N/M ranks; they meet at `--master-addr:--master-port`.
* torchrun: each process it starts joins as the RANK in its environment (WORLD_SIZE must be
  N); torchrun supervises them.

Faults: a rank that exits or stops answering ends the engine (exit 9, naming the rank where it
was one of this node's); a rank that fails while the group starts ends rank 0 with its status.
Every collective has a time-out (`--tensor-parallel-timeout-s`); an idle leader sends a
heartbeat every `lockstep.HEARTBEAT_S`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Rank:
    """Where this process stands among the ranks."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # ranks on this node

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_of(settings) -> Rank | None:
    """This process's rank: from torchrun's (or `spawn`'s) environment where WORLD_SIZE is set,
    else this node's first; None without tensor parallel."""
    size = settings.tensor_parallel_size
    if size == 1:
        return None
    per_node = size // settings.nnodes
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"WORLD_SIZE {world} in the environment, but --tensor-parallel-size {size}")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", per_node))
        return Rank(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)
    return Rank(settings.node_rank * per_node, size, 0, per_node)


class Children:
    """The ranks of this node that this process started (`spawn`), watched: one that exits
    while the group starts ends this process with its status."""

    def __init__(self, procs: dict[int, subprocess.Popen], timeout_s: float) -> None:
        self.procs = procs
        self.timeout_s = timeout_s  # the collectives' time-out (`_watch`)
        self.ready = False  # the server serves: a rank lost from here on is the engine's to report
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="kvserve-ranks", daemon=True)
        self._watcher.start()

    def lost(self) -> str | None:
        """Why a started rank is gone ("rank 1 (pid 123) was killed by signal SIGKILL"), or
        None while all run (or ended cleanly: told to stop)."""
        for rank, proc in self.procs.items():
            status = proc.poll()
            if status:
                return f"rank {rank} (pid {proc.pid}) {_ended(status)}"
        return None

    def failed(self) -> tuple[int, str] | None:
        """(exit status, which rank) of a rank that failed with a status of its own (a start-up
        error it named, not a lost rank 0), or None."""
        from server import exits

        for rank, proc in self.procs.items():
            status = proc.poll()
            if status is not None and status > 0 and status != exits.ENGINE_DEAD:
                return status, f"rank {rank} (pid {proc.pid}) {_ended(status)}"
        return None

    def _watch(self) -> None:
        """A rank lost while the group starts ends this process now, with the lost rank's
        status. Once serving, the engine reports it (exit 9); should this process still run a
        time-out later (blocked in a collective that never fails: NCCL), it ends it so."""
        from server import exits

        lost_at = None
        while not self._stopping:
            why = self.lost()
            if why is not None and not self.ready:
                failed = self.failed()
                self._exit(failed[0] if failed else exits.ENGINE_DEAD, f"cannot start: {why}" + ("; its line above says why" if failed else ""))
            if why is not None and lost_at is None:
                lost_at = time.monotonic()
            if lost_at is not None and time.monotonic() - lost_at > self.timeout_s + 10:
                self._exit(exits.ENGINE_DEAD, f"the engine died: {why}")
            time.sleep(0.2)

    def _exit(self, status: int, why: str) -> None:
        from server import exits

        log.critical(why)
        print(f"kvserve: exiting with status {status} ({exits.STATUSES.get(status, '')}): {why}", file=sys.stderr, flush=True)
        self.stop(0)
        os._exit(status)

    def stop(self, grace_s: float = 30.0) -> None:
        """Wait up to `grace_s` for the ranks to end (rank 0's engine told them to stop), then
        kill what is left."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_children: Children | None = None


def children() -> Children | None:
    """This node's started ranks (on the process that started them)."""
    return _children


def spawn(settings, rank: Rank, argv: list[str]) -> Children | None:
    """Start this node's other ranks as `kvserve <argv>` child processes (rank 0's port chosen
    free on one node), unless torchrun started them; sets MASTER_ADDR and MASTER_PORT here."""
    global _children
    if "WORLD_SIZE" in os.environ:
        return None
    port = settings.master_port or _free_port(settings.master_addr, besides=settings.port)
    env = {**os.environ, "MASTER_ADDR": settings.master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(rank.world),
           "LOCAL_WORLD_SIZE": str(rank.local_world)}
    os.environ.update(MASTER_ADDR=settings.master_addr, MASTER_PORT=str(port), LOCAL_RANK="0")
    procs, parent = {}, os.getpid()
    for local in range(1, rank.local_world):
        procs[rank.rank + local] = subprocess.Popen(
            [sys.executable, "-m", "server.cli", *argv],
            env={**env, "RANK": str(rank.rank + local), "LOCAL_RANK": str(local)},
            preexec_fn=lambda: _die_with(parent),
        )
    log.info("started ranks %s of %d (pids %s), meeting at %s:%d", list(procs), rank.world,
             [p.pid for p in procs.values()], settings.master_addr, port)
    _children = Children(procs, settings.tensor_parallel_timeout_s)
    return _children


def _die_with(parent: int) -> None:
    """In a started rank, before it runs: killed when `parent`, the rank that started it, dies
    (already gone: at once)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _free_port(host: str, besides: int) -> int:
    """A port free on `host` now, other than `besides`: the HTTP port, not bound until the ranks
    have met, may itself be a free port the kernel would hand out again."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != besides:
            return port


def _ended(status: int) -> str:
    if status < 0:
        return f"was killed by signal {signal.Signals(-status).name}"
    return f"exited with status {status}"


def ignore_stop_signals(rank: Rank) -> None:
    """Every rank but 0 leaves SIGINT and SIGTERM to rank 0, which drains and then stops it (a
    Ctrl+C reaches the whole process group; torchrun and Kubernetes signal every process): it
    ends when told, when rank 0 is gone, or by SIGKILL."""
    if not rank.leader:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# -- the group -----------------------------------------------------------------------------------


class Group:
    """The joined ranks: torch.distributed's default group (the model's collectives: NCCL on
    CUDA, gloo on CPU) and `control`, a gloo group for the leader's broadcasts."""

    def __init__(self, rank: Rank, device_type: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        if device_type == "cuda":
            torch.cuda.set_device(rank.local_rank)
        else:  # this node's cores shared among its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.local_world))
        os.environ.setdefault("LOCAL_RANK", str(rank.local_rank))
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        log.info("rank %d of %d joining at %s:%s", rank.rank, rank.world, addr, port)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=rank.rank, world_size=rank.world, timeout=self.timeout)
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.backend = dist.get_backend()

    def agree(self, budget_bytes: int, shard: dict) -> tuple[int, list[dict]]:
        """The KV budget every rank can hold (the smallest), and every rank's `shard` summary
        (what `serve --check` prints), in rank order."""
        import torch.distributed as dist

        gathered: list[dict | None] = [None] * self.rank.world
        dist.all_gather_object(gathered, {**shard, "rank": self.rank.rank, "kv_budget_bytes": budget_bytes}, group=self.control)
        return min(int(s["kv_budget_bytes"]) for s in gathered), gathered

    def share(self, value):
        """Rank 0's `value` on every rank (the others pass None)."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


_group: Group | None = None


def join(settings, device_type: str) -> Group | None:
    """Join the ranks (once per process); None without tensor parallel."""
    global _group
    rank = rank_of(settings)
    if rank is None or _group is not None:
        return _group
    _group = Group(rank, device_type, settings.tensor_parallel_timeout_s)
    return _group


def group() -> Group | None:
    """The joined group, or None (one process)."""
    return _group
