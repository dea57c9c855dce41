"""The KV budget at start-up (server/kv_budget.py): a budget below one sequence at the full
context is a clear start-up error; the capacity in tokens is logged and reported by /metrics and
/v1/models; --kv-cache-dtype fp8 serves with reuse. The GPU measurement runs where a GPU is."""

import asyncio
import gc
import logging
import weakref

import pytest
import torch
from asgi_lifespan import LifespanManager

from cache_manager import kv
from server import kv_budget
from server.startup import create_app
from server.cli import build_parser, settings_from_args
from server.settings import Settings
from tests.device import SETTINGS, needs_cuda
from tests.server.test_api import MODEL

PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2 fp32
PER_TOKEN_FP8 = 2 * 30 * 3 * (64 + 2)


def test_a_budget_below_one_full_context_names_both_and_the_way_out(smollm2):
    config = smollm2.model.config
    budget = kv_budget.Budget(100 * PER_TOKEN, "--kv-budget-bytes")
    with pytest.raises(kv_budget.KVBudgetError) as error:
        kv_budget.check(budget, budget.nbytes, config, torch.float32, "auto", 8192)
    message = str(error.value)
    for part in (f"({100 * PER_TOKEN} bytes)", "--kv-budget-bytes", "holds 96 tokens", f"{PER_TOKEN} bytes per token",
                 "full context of 8192 tokens", f"({8192 * PER_TOKEN} bytes)", "--max-model-len to at most 96", "fp8"):
        assert part in message, (part, message)
    assert kv_budget.check(budget, budget.nbytes, config, torch.float32, "auto", 96) == 96
    # the same bytes hold almost 4 times the tokens in fp8
    assert kv_budget.check(budget, budget.nbytes, config, torch.float32, "fp8", 256) == 100 * PER_TOKEN // (16 * PER_TOKEN_FP8) * 16


def test_attention_workspace_of_a_32b_shape():
    """Qwen2.5-32B: 64 layers, 40 heads, 8 KV heads of 128; 16 decode rows over 32k positions
    gather 16 x 32768 x 8 x 128 keys and values in bf16 (2 GiB), plus their masks; fp8 adds the
    raw bytes gathered before dequantizing."""
    lay = kv.Layout((None,) * 64, 8, 128, 128)
    auto = kv_budget.attention_workspace(lay, 40, torch.bfloat16, "auto", rows=16, chunk=512, context=32768)
    assert auto == 16 * 32768 * (2 * 8 * 128 * 2 + 2)
    fp8 = kv_budget.attention_workspace(lay, 40, torch.bfloat16, "fp8", rows=16, chunk=512, context=32768)
    assert fp8 == 16 * 32768 * (2 * 8 * 128 * 2 + 2 * 8 * 130 + 2)
    # one long chunk over the context: its mask dominates
    chunk = kv_budget.attention_workspace(lay, 40, torch.bfloat16, "auto", rows=1, chunk=8192, context=32768)
    assert chunk == 32768 * 2 * 8 * 128 * 2 + 5 * 8192 * 32768 * 2


def test_cpu_keeps_the_share_of_ram_and_the_flag_wins(smollm2):
    cpu = kv_budget.choose(Settings(**SETTINGS), smollm2.model, torch.device("cpu"), 8192)
    assert "--kv-budget-fraction 0.25" in cpu.how and cpu.nbytes > 0
    given = kv_budget.choose(Settings(**SETTINGS, kv_budget_bytes=12345), smollm2.model, torch.device("cpu"), 8192)
    assert given == kv_budget.Budget(12345, "--kv-budget-bytes")


def test_the_flags_parse_and_refuse_unknown_kv_dtypes():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.85"])
    settings = settings_from_args(args)
    assert settings.kv_cache_dtype == "fp8" and settings.gpu_memory_utilization == 0.85
    with pytest.raises((SystemExit, ValueError)):
        settings_from_args(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"]))


async def _start(smollm2, **overrides):
    """The app's lifespan until the model is ready or failed: (state, app manager)."""
    app = create_app(Settings(**{**SETTINGS, **overrides}), loaded=smollm2)
    manager = LifespanManager(app)
    await manager.__aenter__()
    state = app.state.kv
    for _ in range(600):
        if state.ctx is not None or state.load_error is not None:
            break
        await asyncio.sleep(0.05)
    return state, manager


@pytest.mark.anyio
async def test_a_budget_too_small_for_the_context_is_a_start_up_error(smollm2, caplog):
    caplog.set_level(logging.ERROR, logger="server.startup")
    state, manager = await _start(smollm2, kv_budget_bytes=64 * 2**20)  # 1456 tokens < 8192
    try:
        assert state.ctx is None and state.load_error is not None
        assert "one sequence at the full context of 8192 tokens" in state.load_error
        assert "--max-model-len to at most 1456" in state.load_error
        assert any("cannot start" in r.message and "8192" in r.message for r in caplog.records)
    finally:
        await manager.__aexit__(None, None, None)
    state, manager = await _start(smollm2, kv_budget_bytes=64 * 2**20, max_model_len=1456)  # the way out
    try:
        assert state.ctx is not None and state.load_error is None
    finally:
        await manager.__aexit__(None, None, None)


@pytest.mark.anyio
async def test_shutdown_gives_the_pool_memory_back_whoever_still_holds_the_pool(smollm2):
    """Something that outlives the app (a logged traceback's frames, say) may keep the Pool
    object, never its memory: a model started next in the same process measures its own budget
    (on an H200 a second app once saw the first one's 127.5 GiB still in use)."""
    state, manager = await _start(smollm2, kv_budget_bytes=64 * 2**20, max_model_len=1024)
    pool = state.ctx.cache_manager.pool  # the stale reference
    storage = weakref.ref(pool.keys[0].untyped_storage())
    await manager.__aexit__(None, None, None)
    gc.collect()
    assert storage() is None and pool.keys == pool.values == []
    state.abort_in_flight()  # a second shutdown (SIGTERM after the lifespan) is harmless


@pytest.mark.anyio
async def test_fp8_server_reports_capacity_in_tokens_and_reuses_sessions(app_client, caplog):
    caplog.set_level(logging.INFO, logger="server.startup")
    budget = 4096 * PER_TOKEN_FP8
    async with app_client(kv_budget_bytes=budget, kv_cache_dtype="fp8", max_model_len=4096) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["kv_cache"] == {"dtype": "fp8", "capacity_tokens": 4096, "bytes_per_token": PER_TOKEN_FP8}
        assert (await client.get(f"/v1/models/{MODEL}")).json()["kv_cache"]["capacity_tokens"] == 4096
        messages = [{"role": "user", "content": "Name three rivers."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "prompt_cache_key": "r"}
        first = (await client.post("/v1/chat/completions", json=body)).json()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And two lakes."}]
        second = (await client.post("/v1/chat/completions", json=body | {"messages": messages})).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        text = (await client.get("/metrics")).text
    assert "kvserve_kv_cache_capacity_tokens 4096.0" in text
    used = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvserve_kv_cache_tokens_used "))
    assert 0 < used <= 4096 and used % 16 == 0
    assert any("4096 tokens of fp8 KV (11880 bytes per token)" in r.message for r in caplog.records)


@needs_cuda
def test_the_gpu_budget_is_measured_after_loading():
    """On a GPU: the measured budget leaves the activation peak, the workspace and the reserve
    free, and fits in what is free now."""
    from tests.server.test_kv_tiers import cuda_model

    loaded = cuda_model()
    budget = kv_budget.choose(Settings(device="cuda", dtype="float32"), loaded.model, loaded.device, 8192)
    free, total = torch.cuda.mem_get_info(loaded.device)
    assert budget.how.startswith("measured") and 0 < budget.nbytes < free
    assert budget.nbytes <= 0.9 * total
    lower = kv_budget.choose(Settings(device="cuda", dtype="float32", gpu_memory_utilization=0.5), loaded.model, loaded.device, 8192)
    assert lower.nbytes < budget.nbytes
