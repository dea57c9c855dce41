"""Shared by benchmarks and e2e tests: start a real `kvserve serve` process and wait for /ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def metric(self, name: str, headers: dict | None = None) -> float:
        """The value of one unlabelled sample from /metrics."""
        for line in httpx.get(self.url + "/metrics", headers=headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextlib.contextmanager
def launch(log_dir: Path, *flags: str, env: dict | None = None, ready_timeout_s: float = 180):
    """Run `kvserve serve` on a free port until the block ends (SIGTERM, then kill)."""
    port = free_port()
    log_path = Path(log_dir) / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, port, log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in time:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def launch_with_metrics_port(log_dir: Path, *flags: str, env: dict | None = None):
    """`launch` with a separate --metrics-port; the server gets a `metrics_url` attribute."""
    metrics_port = free_port()
    with launch(log_dir, *flags, "--metrics-port", str(metrics_port), env=env) as server:
        server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield server
