"""Faults inside the engine on the real SmolLM2 model: a row whose forward pass or sampling
fails fails alone (the others' tokens are those of a run without the fault), an out-of-memory
step shrinks until every stream finishes, and a model that cannot run kills the engine (or
never starts it). Faults are injected through server/engine/faults.py's test-only switch, or by
breaking the real model's forward with a hook."""

from __future__ import annotations

import asyncio

import pytest

from cache_manager.manager import CacheConfig, CacheManager
from server.engine import faults
from server.engine.core import Engine, EngineConfig, EngineStopped, StartupCheckFailed
from server.engine.sequence import GenerationRequest
from server.metrics import Metrics
from tests.server.test_engine import PROMPTS, chat_ids, greedy, run

LONG = [{"role": "user", "content": "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 30}]


@pytest.fixture
def make_engine(smollm2, monkeypatch):
    """Engines on the shared model, with the request switch on (or `switch`)."""
    engines = []

    def make(switch: str = "requests", proposer=None, **overrides):
        monkeypatch.setenv(faults.ENV, switch)
        config = EngineConfig(max_context=smollm2.max_context, **overrides)
        # no reuse between requests: a repeated prompt is prefilled again, in the same steps
        cache_config = CacheConfig(budget_bytes=2**30, anonymous_reuse=False)
        cache = CacheManager(smollm2.model.config, smollm2.device, smollm2.dtype, smollm2.max_context, cache_config)
        e = Engine(smollm2.model, smollm2.tokenizer, config, cache, metrics=Metrics(), proposer=proposer)
        engines.append(e)
        e.start()
        return e

    make.engines = engines
    yield make
    for e in engines:
        e.stop()


def fault_count(engine, kind: str) -> float:
    return engine.metrics.engine_faults.labels(kind)._value.get()


def run_all(engine, prompts, fault_at=None, fault=None, max_tokens=12):
    """Every prompt as one request, all at once; request `fault_at` carries `fault`."""
    async def go():
        requests = [
            GenerationRequest(f"r{i}", ids, greedy(max_tokens), fault=fault if i == fault_at else None)
            for i, ids in enumerate(prompts)
        ]
        return await asyncio.gather(*(run(engine, r) for r in requests))

    return asyncio.run(go())


@pytest.fixture
def prompts(smollm2):
    return [chat_ids(smollm2.tokenizer, m) for m in PROMPTS + [[{"role": "user", "content": "Name a fruit."}]]]


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
@pytest.mark.parametrize("fault,kind", [("forward", "forward"), ("sample", "sampling")])
def test_a_failing_row_fails_alone_and_the_others_keep_their_tokens(make_engine, prompts, paged, fault, kind):
    engine = make_engine(paged=paged)
    clean = run_all(engine, prompts)
    faulty = run_all(engine, prompts, fault_at=2, fault=fault)
    for i, ((tokens, _, final), (want, _, _)) in enumerate(zip(faulty, clean)):
        if i == 2:
            assert final.finish_reason == "error" and final.error == "internal"
        else:
            assert final.error is None and tokens == want, i
    assert fault_count(engine, kind) >= 1
    assert fault_count(engine, "engine_dead") == 0 and engine.dead is None
    assert run_all(engine, prompts[:1])[0][0] == clean[0][0]  # and it keeps serving


def test_a_single_failing_row_is_checked_against_a_known_good_pass(make_engine, prompts):
    engine = make_engine()
    [(_, _, final)] = run_all(engine, prompts[:1], fault_at=0, fault="forward")
    assert final.error == "internal"
    assert engine.dead is None  # the check passed: the row was at fault, not the model
    [(tokens, _, final)] = run_all(engine, prompts[:1])
    assert final.error is None and tokens


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_out_of_memory_on_a_long_prefill_shrinks_the_step_and_every_stream_finishes(make_engine, smollm2, prompts, paged):
    engine = make_engine(paged=paged, max_batch_tokens=512)
    long_ids = chat_ids(smollm2.tokenizer, LONG)
    assert len(long_ids) > 8 * faults.OOM_TOKENS

    async def go(fault):
        # the decoding streams start first, then the long prompt's prefill joins their steps
        streams = [asyncio.create_task(run(engine, GenerationRequest(f"d{i}", ids, greedy(24)))) for i, ids in enumerate(prompts)]
        await asyncio.sleep(0.3)
        long = await run(engine, GenerationRequest("long", long_ids, greedy(8), fault=fault))
        return await asyncio.gather(*streams), long

    clean_streams, clean_long = asyncio.run(go(None))
    streams, (tokens, _, final) = asyncio.run(go("oom"))
    assert final.error is None and final.finish_reason == "length" and len(tokens) == 8
    assert tokens == clean_long[0]
    for (got, _, done), (want, _, _) in zip(streams, clean_streams):
        assert done.error is None and got == want
    assert fault_count(engine, "oom_shrink") >= 1 and fault_count(engine, "oom_row") == 0
    assert engine.scheduler.max_batch_tokens <= faults.OOM_TOKENS  # later steps prefill in smaller chunks


def test_out_of_memory_with_a_draft_drops_the_draft_and_keeps_the_tokens(make_engine, smollm2, monkeypatch):
    """A drafted row that runs out of memory alone retries without its draft (the proposer
    rewinds); speculation gives the greedy tokens either way."""
    from server.engine.prompt_lookup import NgramProposer

    monkeypatch.setattr(faults, "OOM_TOKENS", 1)  # any pass of more than one token runs out
    engine = make_engine(proposer=NgramProposer(), max_batch_tokens=512)
    ids = chat_ids(smollm2.tokenizer, [{"role": "user", "content": "Repeat exactly: one two three, one two three, one two three."}])
    [(clean, _, _)] = run_all(engine, [ids], max_tokens=24)
    [(tokens, _, final)] = run_all(engine, [ids], fault_at=0, fault="oom", max_tokens=24)
    assert final.error is None and tokens == clean
    assert fault_count(engine, "oom_shrink") >= 2 and fault_count(engine, "oom_row") == 0


def test_a_model_that_breaks_while_serving_kills_the_engine(make_engine, smollm2, prompts):
    engine = make_engine()
    run_all(engine, prompts[:1])

    def broken(module, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    hook = smollm2.model.register_forward_pre_hook(broken)
    try:
        results = run_all(engine, prompts)
    finally:
        hook.remove()
    assert all(final.error == "engine_dead" for _, _, final in results)
    assert engine.dead and "known-good forward pass fails too" in engine.dead
    assert fault_count(engine, "engine_dead") == 1

    async def submit():
        engine.submit(GenerationRequest("late", prompts[0], greedy(2)), asyncio.get_running_loop())

    with pytest.raises(EngineStopped):
        asyncio.run(submit())


def test_a_model_that_cannot_run_fails_the_start_up_check(make_engine, smollm2, prompts):
    with pytest.raises(StartupCheckFailed, match="start-up forward pass failed"):
        make_engine(switch="model")
    make_engine.engines.pop().stop()  # the switch's hook leaves with its engine: the model runs again
    [(tokens, _, final)] = run_all(make_engine(), prompts[:1])
    assert final.error is None and tokens
