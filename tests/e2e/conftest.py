"""Real `kvserve serve` processes (uvicorn), driven by the official openai SDK and httpx."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import test_cache_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: str) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metric(self, name: str, headers: dict | None = None) -> float:
        """The value of one unlabelled sample from /metrics."""
        for line in httpx.get(self.url + "/metrics", headers=headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextlib.contextmanager
def launch(tmp_path_factory, *flags: str, env: dict | None = None, wait_ready: bool = True):
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("server") / "server.log")
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--cache-dir", str(test_cache_dir()), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, port, log_path)
    try:
        deadline = time.monotonic() + 180
        while wait_ready:
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An open server with default settings."""
    with launch(tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """API keys on, one running sequence, one waiting slot and a short deadline."""
    with launch(
        tmp_path_factory,
        "--api-key", "key-a", "--max-running", "1", "--max-queue", "1", "--request-timeout-s", "4",
        env={"KVSERVE_MODEL_ALIASES": "smol,gpt-local"},
    ) as s:
        yield s
