"""The gauges llm-d / Gateway API Inference Extension schedulers read by default, under vLLM's
names, derived from kvserve's own: in-process on the real model."""

import pytest

from tests.server.test_api import HELLO, MODEL

pytestmark = pytest.mark.anyio


def samples(text: str) -> dict[str, float]:
    # NOTE: the value is after the last space (label values may hold spaces: the engine paths)
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


async def test_vllm_gauges_follow_kvserves_own(app_client):
    async with app_client() as client:
        fresh = samples((await client.get("/metrics")).text)
        assert fresh["vllm:num_requests_waiting"] == fresh["vllm:num_requests_running"] == 0
        assert fresh["vllm:kv_cache_usage_perc"] == 0
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0, "prompt_cache_key": "s1"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        after = samples((await client.get("/metrics")).text)
    # the idle resident session counts: its cache is held against the budget
    assert after["vllm:kv_cache_usage_perc"] > 0
    assert after["vllm:kv_cache_usage_perc"] == pytest.approx(after["kvserve_kv_cache_bytes_used"] / after["kvserve_kv_cache_bytes_budget"])
    assert after["vllm:num_requests_running"] == after["kvserve_requests_running"] == 0
