"""The worker endpoints a router calls (server/api/routes/router_compat.py), in-process on the real
model: SGLang's /server_info and load report (/v1/loads, /loads) in the shapes SMG parses,
filled from the engine's own counts."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.test_api import HELLO, MODEL, assert_error_shape
from tests.server.test_sessions_api import metric

pytestmark = pytest.mark.anyio
SMG_QUERY = "/v1/loads?include=core,disagg,queues,memory"  # what SMG 1.13 asks
RANK_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "token_usage", "max_running_requests"}


async def loads(client, path: str = "/v1/loads") -> dict:
    reply = await client.get(path)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_server_info_describes_the_replica(app_client):
    async with app_client(max_running=3, max_queue=5, max_model_len=1024) as client:
        info = (await client.get("/server_info")).json()
    assert info == {
        "served_model_name": MODEL, "context_length": 1024, "max_running_requests": 3,
        "max_queued_requests": 5, "tp_size": 1, "dp_size": 1, "pp_size": 1, "is_embedding": False,
        "disaggregation_mode": "null", "version": info["version"],
    }
    assert info["version"]


async def test_idle_load_report(app_client):
    async with app_client(max_running=3) as client:
        report = await loads(client, SMG_QUERY)
        assert report["dp_rank_count"] == 1 and report["timestamp"] and report["version"]
        (rank,) = report["loads"]
        assert rank == {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_reqs": 0,
                        "token_usage": 0.0, "max_running_requests": 3,
                        "queues": {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0}}
        assert report["aggregate"] == {"total_running_reqs": 0, "total_waiting_reqs": 0, "total_reqs": 0, "avg_token_usage": 0.0}
        assert set((await loads(client, "/v1/loads?include=core"))["loads"][0]) == RANK_FIELDS  # no queues section
        assert (await loads(client, f"/loads?model={MODEL}"))["loads"][0]["queues"]["waiting"] == 0
        assert (await loads(client, "/loads"))["dp_rank_count"] == 1


async def test_load_report_counts_running_and_waiting_requests(app_client):
    """One sequence runs, the other waits (--max-running 1); both hold KV while in flight. Once
    they finish, the sessions' caches stay resident but are not load: token_usage is 0 again,
    while vllm:kv_cache_usage_perc (budget in use, idle sessions included) is not."""
    long = {"model": MODEL, "messages": HELLO, "max_tokens": 40, "logit_bias": {"2": -100}}
    async with app_client(max_running=1, kv_budget_bytes=64 * 2**20, max_model_len=1024) as client:
        requests = [asyncio.create_task(client.post("/v1/chat/completions", json=long | {"prompt_cache_key": key}))
                    for key in ("first", "second")]
        for _ in range(500):
            (rank,) = (await loads(client, SMG_QUERY))["loads"]
            if rank["num_running_reqs"] == 1 and rank["num_waiting_reqs"] == 1:
                break
            await asyncio.sleep(0.01)
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (1, 1, 2), rank
        assert rank["queues"]["waiting"] == 1 and 0 < rank["token_usage"] < 1
        assert [(await r).status_code for r in requests] == [200, 200]
        report = await loads(client)
        (rank,) = report["loads"]
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["token_usage"]) == (0, 0, 0.0)
        assert report["aggregate"]["total_reqs"] == 0
        assert metric((await client.get("/metrics")).text, "vllm:kv_cache_usage_perc") > 0  # the two idle sessions


async def test_bad_queries_are_clear_4xx(app_client):
    async with app_client(model_aliases=["smol"]) as client:
        assert (await client.get("/loads?model=smol")).status_code == 200
        assert_error_shape(await client.get("/loads?model=gpt-4"), 404, "model_not_found", "model")
        assert_error_shape(await client.get("/v1/loads?include=core,bogus"), 400, "invalid_value", "include")
        assert_error_shape(await client.get("/v1/loads?dp_rank=1"), 400, "invalid_value", "dp_rank")
        assert_error_shape(await client.get("/v1/loads?dp_rank=x"), 400, "invalid_value", "dp_rank")
        assert (await client.get("/v1/loads?dp_rank=0")).status_code == 200


async def test_keys_guard_them_like_v1_models(app_client):
    async with app_client(api_key=["sk-a"]) as client:
        for path in ("/server_info", "/v1/loads", "/loads", "/v1/models"):
            assert_error_shape(await client.get(path), 401, "invalid_api_key")
            assert (await client.get(path, headers={"Authorization": "Bearer sk-a"})).status_code == 200
