"""Start-up errors on real `kvserve serve` processes: each error no request can fix ends the
process with its status (server/exits.py, the manual's docs/reference/exit-status.md) and one line that says what is
wrong; a model that cannot run is never reported ready; `serve --check` exits 0 with what it
would serve with, or 1 with the reason."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import free_port
from server import exits
from tests.conftest import test_cache_dir as cache_dir
from tests.device import SERVE_FLAGS

EXIT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "exit-status.md"


def serve(tmp_path: Path, *flags: str, env: dict | None = None, timeout_s: float = 240) -> tuple[int, str, list[int]]:
    """Run `kvserve serve` until it exits; (status, its output, the /ready statuses seen)."""
    import os

    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--cache-dir", str(cache_dir()), *SERVE_FLAGS, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}, cwd=tmp_path)
    seen: list[int] = []

    def poll() -> None:
        while proc.poll() is None:
            try:
                seen.append(httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    watcher.join(5)
    return proc.returncode, out, seen


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_a_missing_model_exits_4_naming_it(tmp_path):
    status, out, _ = serve(tmp_path, "--model", str(tmp_path / "nowhere.gguf"))
    assert status == exits.MODEL_SOURCE, out
    assert "GGUF file not found" in last_line(out) and "status 4" in last_line(out)


def test_an_unsupported_family_exits_5_naming_the_feature(tmp_path, tokenizer):
    from tests.server.test_families import tiny

    model_dir = tmp_path / "tiny-dynamic-rope"
    tiny(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    status, out, seen = serve(tmp_path, "--model", str(model_dir))
    assert status == exits.UNSUPPORTED, out
    assert "[dynamic-rope]" in last_line(out)
    assert 200 not in seen


def test_an_architecture_transformers_does_not_know_exits_5(tmp_path):
    model_dir = tmp_path / "foo"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "foo_bar_lm", "architectures": ["FooBarForCausalLM"]}))
    status, out, _ = serve(tmp_path, "--model", str(model_dir))
    assert status == exits.UNSUPPORTED, out
    assert "cannot build a causal LM" in last_line(out) and "foo_bar_lm" in last_line(out)


def test_a_kv_budget_below_one_sequence_exits_6_saying_what_to_lower(tmp_path):
    status, out, seen = serve(tmp_path, "--kv-budget-bytes", str(2**20))
    assert status == exits.KV_BUDGET, out
    assert "--max-model-len" in last_line(out)
    assert 200 not in seen


def test_a_model_whose_forward_always_raises_never_turns_ready_and_exits_7(tmp_path):
    status, out, seen = serve(tmp_path, env={"KVSERVE_TEST_FAULTS": "model"})
    assert status == exits.MODEL_CANNOT_RUN, out
    assert "start-up forward pass failed" in last_line(out) and "injected: the model cannot run" in last_line(out)
    assert 200 not in seen


def test_required_cuda_graphs_that_are_not_captured_exit_8(tmp_path):
    # off a GPU there are none; the capture fault makes one fail on a GPU too
    status, out, seen = serve(tmp_path, "--cuda-graphs", "require", env={"KVSERVE_TEST_FAULTS": "capture"})
    assert status == exits.REQUIRED_PATH, out
    assert "--cuda-graphs=require" in last_line(out)
    assert 200 not in seen


def test_a_required_compilation_that_cannot_happen_exits_8_saying_why(tmp_path):
    # exact mode keeps its own kernels: no compiled forward, on any device
    status, out, seen = serve(tmp_path, "--compile", "require", "--deterministic")
    assert status == exits.REQUIRED_PATH, out
    assert "--compile=require" in last_line(out) and "exact mode" in last_line(out)
    assert 200 not in seen


def test_invalid_settings_exit_2_and_a_taken_port_exits_3(tmp_path):
    status, out, _ = serve(tmp_path, "--max-running", "0")
    assert status == exits.SETTINGS and "max_running" in out, out
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--model", str(tmp_path / "nowhere.gguf")],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )
    assert done.returncode == exits.BIND, done.stderr


def test_serve_check_prints_capacity_and_paths_then_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--check", "--cache-dir", str(cache_dir()), *SERVE_FLAGS, "--max-model-len", "4096"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["max_model_len"] == 4096
    assert summary["kv_cache"]["capacity_tokens"] >= 4096 and summary["kv_cache"]["sequences_at_max_model_len"] >= 1
    assert summary["engine"]["attention"] in ("rows", "paged") and summary["engine"]["fallbacks"] == {}
    assert summary["engine"]["merged"] == "qkv 30, gate_up 30"  # SmolLM2: each layer's projections, one GEMM each


def test_serve_check_exits_1_with_the_reason(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--check", "--model", str(tmp_path / "nowhere.gguf")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "check failed: GGUF file not found" in done.stderr and "status 4" in done.stderr


def test_the_manual_lists_every_exit_status():
    """docs/reference/exit-status.md (generated from server/exits.py) has a row per status."""
    text = EXIT_PAGE.read_text()
    table = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", text, flags=re.MULTILINE))
    assert {int(k) for k in table} == set(exits.STATUSES), table
