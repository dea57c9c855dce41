"""The engine on the real SmolLM2 model: equivalence with transformers, scheduling, aborts."""

import asyncio

import pytest
import torch

from server.engine import attention
from cache_manager.manager import CacheConfig, CacheManager
from server.engine.core import Engine, EngineConfig, EngineStopped, QueueFull
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from tests.device import DEVICE

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "List three colors."}],
]


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def engine(smollm2):
    engines = []

    def make(**overrides):
        config = EngineConfig(max_context=smollm2.max_context, **overrides)
        cache = CacheManager(smollm2.model.config, smollm2.device, smollm2.dtype, smollm2.max_context, CacheConfig(budget_bytes=2**31))
        e = Engine(smollm2.model, smollm2.tokenizer, config, cache)
        e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


async def run(engine, request):
    tokens, text, final = [], "", None
    async for out in engine.submit(request, asyncio.get_running_loop()):
        tokens += [t.token_id for t in out.tokens]
        text += out.text
        final = out
    return tokens, text, final


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_greedy_equals_transformers_generate(smollm2, engine):
    eng = engine()
    for messages in PROMPTS:
        ids = chat_ids(smollm2.tokenizer, messages)
        ref = smollm2.model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        if ref and ref[-1] == 2:
            ref = ref[:-1]  # the engine does not report end-of-turn as a token
        tokens, text, final = asyncio.run(run(eng, GenerationRequest("r", ids, greedy(24))))
        assert tokens == ref
        assert text == smollm2.tokenizer.decode(ref, skip_special_tokens=True)
        assert final.finish_reason == ("length" if len(ref) == 24 else "stop")
        assert final.prompt_tokens == len(ids) and final.completion_tokens == len(tokens)


def test_concurrent_requests_interleave_and_match_solo_outputs(smollm2, engine):
    eng = engine()
    reqs = [GenerationRequest(f"r{i}", chat_ids(smollm2.tokenizer, m), greedy(12 + 6 * i)) for i, m in enumerate(PROMPTS)]
    solo = [asyncio.run(run(eng, r))[0] for r in reqs]
    order = []

    async def tagged(i, r):
        tokens = []
        async for out in eng.submit(r, asyncio.get_running_loop()):
            if out.tokens:
                order.append(i)
            tokens += [t.token_id for t in out.tokens]
        return tokens

    async def all_at_once():
        return await asyncio.gather(*(tagged(i, r) for i, r in enumerate(reqs)))

    together = asyncio.run(all_at_once())
    assert together == solo
    # every running request advanced every step: the first tokens of all three arrive before
    # any of them has produced its fifth token
    first_three = order[: 3]
    assert sorted(first_three) == [0, 1, 2]


def test_stop_strings_max_tokens_and_bias(smollm2, engine):
    eng = engine()
    ids = chat_ids(smollm2.tokenizer, PROMPTS[0])
    _, full, _ = asyncio.run(run(eng, GenerationRequest("a", ids, greedy(30))))
    stop = full[10:14]
    _, text, final = asyncio.run(run(eng, GenerationRequest("b", ids, greedy(30, stop=(stop,)))))
    assert final.finish_reason == "stop" and text == full[: full.index(stop)]
    tokens, _, final = asyncio.run(run(eng, GenerationRequest("c", ids, greedy(3))))
    assert final.finish_reason == "length" and len(tokens) == 3
    forced = smollm2.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    tokens, _, _ = asyncio.run(run(eng, GenerationRequest("d", ids, greedy(3, logit_bias={forced: 100.0}))))
    assert tokens == [forced] * 3
    tokens_pen, _, _ = asyncio.run(run(eng, GenerationRequest("e", ids, greedy(30, frequency_penalty=2.0))))
    tokens_free, _, _ = asyncio.run(run(eng, GenerationRequest("f", ids, greedy(30))))
    assert tokens_pen != tokens_free


def test_seeded_sampling_reproducible(smollm2, engine):
    eng = engine()
    ids = chat_ids(smollm2.tokenizer, PROMPTS[2])
    params = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed)  # noqa: E731
    a = asyncio.run(run(eng, GenerationRequest("a", ids, params(1))))[0]
    b = asyncio.run(run(eng, GenerationRequest("b", ids, params(1))))[0]
    c = asyncio.run(run(eng, GenerationRequest("c", ids, params(2))))[0]
    assert a == b and a != c


def test_cancel_aborts_within_a_step_and_frees(smollm2, engine):
    eng = engine()
    ids = chat_ids(smollm2.tokenizer, PROMPTS[0])

    async def go():
        handle = eng.submit(GenerationRequest("x", ids, greedy(500)), asyncio.get_running_loop())
        n = 0
        async for out in handle:
            n += len(out.tokens)
            if n == 2:
                handle.cancel()
            if out.finished:
                return n, out

    n, final = asyncio.run(go())
    assert final.finish_reason == "abort"
    assert n <= 4  # stopped within a step or two of the cancel, not after 500 tokens
    assert eng.idle


def test_deadline_ends_request_with_timeout(smollm2, engine):
    eng = engine()
    ids = chat_ids(smollm2.tokenizer, PROMPTS[0])
    req = GenerationRequest("t", ids, greedy(500), timeout_s=0.3)
    tokens, _, final = asyncio.run(run(eng, req))
    assert final.finish_reason == "error" and final.error == "timeout"
    assert len(tokens) < 500
    assert eng.idle


def test_queue_bound(smollm2, engine):
    eng = engine(max_queue=1, max_running=1)
    ids = chat_ids(smollm2.tokenizer, PROMPTS[0])

    async def go():
        loop = asyncio.get_running_loop()
        first = eng.submit(GenerationRequest("1", ids, greedy(200)), loop)
        await first.admitted()  # the engine took the first one off the queue
        second = eng.submit(GenerationRequest("2", ids, greedy(200)), loop)
        with pytest.raises(QueueFull):
            eng.submit(GenerationRequest("3", ids, greedy(200)), loop)
        first.cancel()
        second.cancel()
        for h in (first, second):
            async for _ in h:
                pass

    asyncio.run(go())
    assert eng.idle


def test_deadline_and_cancel_also_apply_while_waiting(smollm2, engine):
    eng = engine(max_running=1)
    ids = chat_ids(smollm2.tokenizer, PROMPTS[0])

    async def go():
        loop = asyncio.get_running_loop()
        running = eng.submit(GenerationRequest("run", ids, greedy(300, logit_bias={2: -100.0})), loop)
        waiting = eng.submit(GenerationRequest("wait", ids, greedy(10), timeout_s=0.3), loop)
        cancelled = eng.submit(GenerationRequest("cancel", ids, greedy(10)), loop)
        cancelled.cancel()
        finals = {}
        for name, handle in (("wait", waiting), ("cancel", cancelled)):
            async for out in handle:
                finals[name] = out
        assert not running._seq.status.name == "FINISHED"  # both left the queue while it ran
        running.cancel()
        async for _ in running:
            pass
        return finals

    finals = asyncio.run(go())
    assert finals["wait"].error == "timeout" and finals["cancel"].finish_reason == "abort"
    assert eng.idle


def test_start_raises_when_the_engine_thread_cannot_prepare_the_model(smollm2, monkeypatch):
    """Preparing the model happens on the engine thread (the runner's prepare); a failure there
    is raised by start() (the server reports it on /ready) and the engine takes no requests."""

    def refuse(model):
        raise RuntimeError("this model cannot be prepared")

    monkeypatch.setattr(attention, "enable", refuse)
    cache = CacheManager(smollm2.model.config, smollm2.device, smollm2.dtype, smollm2.max_context, CacheConfig(budget_bytes=2**28))
    eng = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_context=smollm2.max_context), cache)
    with pytest.raises(RuntimeError, match="cannot be prepared"):
        eng.start()

    async def submit():
        eng.submit(GenerationRequest("x", [1, 2, 3], greedy(2)), asyncio.get_running_loop())

    with pytest.raises(EngineStopped):
        asyncio.run(submit())
