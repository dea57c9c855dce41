"""The engine's faults and paths as the HTTP side shows them, in-process on the real SmolLM2
model: an injected row fault is that request's 500 alone, a model that breaks while serving
turns /health and /ready 503 (`serve` then exits 9), and a fallback shows in the log, in
/metrics and in /v1/models."""

from __future__ import annotations

import asyncio
import logging

import pytest

from server.engine import faults
from tests.inprocess import openai_client
from tests.server.test_api import HELLO, MODEL, assert_error_shape

pytestmark = pytest.mark.anyio


def chat(**extra):
    return {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 8, **extra}


async def test_a_row_fault_is_that_requests_500_alone(smollm2, monkeypatch):
    monkeypatch.setenv(faults.ENV, "requests")
    async with openai_client(smollm2) as (_, http):
        bad, good = await asyncio.gather(
            http.post("/v1/chat/completions", json=chat(), headers={"X-Kvserve-Test-Fault": "forward"}),
            http.post("/v1/chat/completions", json=chat()),
        )
        assert_error_shape(bad, 500, "internal_error")
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"]
        metrics = (await http.get("/metrics")).text
        assert 'kvserve_engine_faults_total{kind="forward"} 1.0' in metrics
        assert (await http.get("/health")).status_code == 200


async def test_the_fault_header_is_ignored_without_the_switch(smollm2, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    async with openai_client(smollm2) as (_, http):
        response = await http.post("/v1/chat/completions", json=chat(), headers={"X-Kvserve-Test-Fault": "forward"})
        assert response.status_code == 200


async def test_a_model_that_breaks_while_serving_turns_health_and_ready_503(smollm2):
    async with openai_client(smollm2) as (_, http):
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200

        def broken(module, args):
            raise RuntimeError("CUDA error: device-side assert triggered")

        hook = smollm2.model.register_forward_pre_hook(broken)
        try:
            assert_error_shape(await http.post("/v1/chat/completions", json=chat()), 503, "engine_dead")
        finally:
            hook.remove()
        assert (await http.get("/health")).status_code == 503
        assert (await http.get("/ready")).status_code == 503
        assert_error_shape(await http.post("/v1/chat/completions", json=chat()), 503, "model_unavailable")
        assert 'kvserve_engine_faults_total{kind="engine_dead"} 1.0' in (await http.get("/metrics")).text


async def test_a_failed_graph_capture_shows_in_the_log_the_metric_and_v1_models(smollm2, monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV, "capture")
    caplog.set_level(logging.WARNING)
    async with openai_client(smollm2) as (_, http):
        engine = (await http.get("/v1/models")).json()["data"][0]["engine"]
        assert engine["cuda_graphs"] == "eager"
        assert "injected: graph capture fails" in engine["fallbacks"]["cuda_graphs"]
        metrics = (await http.get("/metrics")).text
        info = next(line for line in metrics.splitlines() if line.startswith("kvserve_engine_paths_info{"))
        assert 'cuda_graphs="eager"' in info and 'fallbacks="cuda_graphs"' in info
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200  # eager decoding serves
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("fallback: cuda_graphs: capturing the decode graphs failed") for m in warnings), warnings


async def test_the_paths_in_use_show_with_no_fallback(smollm2, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    async with openai_client(smollm2) as (_, http):
        engine = (await http.get("/v1/models")).json()["data"][0]["engine"]
        assert engine["fallbacks"] == {} and engine["speculative"] == "off" and engine["exact"] == "off"
        assert engine["attention"] in ("rows", "paged")
        # NOTE: the session's SmolLM2 object may have been packed by a runner that did not merge
        # (merged layers are tested on a fresh server: tests/e2e/test_exits.py)
        assert engine["merged"].startswith(("qkv 30, gate_up 30", "none"))
        assert 'fallbacks=""' in (await http.get("/metrics")).text
