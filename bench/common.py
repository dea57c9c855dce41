"""Shared by benchmarks and e2e tests: start a real server process (`kvserve serve`, a router)
and wait until it is ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx

P = TypeVar("P", bound="Process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A started process that serves HTTP on `port` and writes its output to `log_path`."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class ServerProcess(Process):
    """A `kvserve serve` process."""

    def metric(self, name: str, headers: dict | None = None) -> float:
        """The value of one unlabelled sample from /metrics."""
        for line in httpx.get(self.url + "/metrics", headers=headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextlib.contextmanager
def started(
    kind: type[P],
    cmd: list[str],
    port: int,
    log_path: Path,
    ready: Callable[[P], bool],
    *,
    env: dict | None = None,
    ready_timeout_s: float = 180,
    stop_timeout_s: float = 30,
) -> Iterator[P]:
    """Run `cmd` (output to `log_path`) until the block ends: SIGTERM, then kill after
    `stop_timeout_s`. Yields `kind(proc, port, log_path)` once `ready` of it is true (polled
    every 0.2 s; an HTTP error or a bad JSON answer counts as not ready); raises with the log's
    tail if the process exits or is not ready in time."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    process = kind(proc, port, log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind.__name__} exited early:\n{process.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if ready(process):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind.__name__} not ready in {ready_timeout_s:.0f} s:\n{process.log()[-4000:]}")
            time.sleep(0.2)
        yield process
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def launch(log_dir: Path, *flags: str, env: dict | None = None, ready_timeout_s: float = 180):
    """Run `kvserve serve` on a free port until the block ends (SIGTERM, then kill); ready when
    /ready answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *flags]
    return started(
        ServerProcess, cmd, port, Path(log_dir) / f"server-{port}.log",
        lambda server: httpx.get(server.url + "/ready", timeout=2).status_code == 200,
        env=env, ready_timeout_s=ready_timeout_s,
    )


@contextlib.contextmanager
def launch_with_metrics_port(log_dir: Path, *flags: str, env: dict | None = None):
    """`launch` with a separate --metrics-port; the server gets a `metrics_url` attribute."""
    metrics_port = free_port()
    with launch(log_dir, *flags, "--metrics-port", str(metrics_port), env=env) as server:
        server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield server


def write_readme_block(readme: Path, start: str, end: str, text: str) -> None:
    """Replace what lies between the markers `start` and `end` in `readme` with `text` (a
    benchmark's `--readme`: the README's table is the last run's)."""
    content = readme.read_text()
    at, stop = content.index(start) + len(start), content.index(end)
    readme.write_text(content[:at] + "\n" + text + "\n" + content[stop:])
