"""The batched engine on the real model: many concurrent requests, one forward pass per step,
and every output equals the same request run alone (docs/architecture.md's rule: token-identical, or the
first differing step is a near-tie, logit gap < 1e-4)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from cache_manager.manager import CacheConfig, CacheManager
from grammars import GrammarCompiler, spec_from_request
from server.engine.core import Engine, EngineConfig
from server.metrics import Metrics
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from tests.equivalence import assert_equivalent
from tests import engines
from tests.engines import stopped_after

TOPICS = ["the sea", "a lighthouse", "bread", "rain", "trains", "chess", "the moon", "coffee", "winter", "owls"]
PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["kind", "name", "age"],
    "additionalProperties": False,
}
LONG_DOC = " ".join(f"Note {i}: the harbor ledger lists {i * 7 % 13} crates of copper." for i in range(60))


@pytest.fixture(scope="module")
def compiler(smollm2):
    return GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])


class Bench:
    """One engine (with metrics) on the shared model; runs requests together or alone."""

    def __init__(self, loaded, **engine_kw):
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.metrics = Metrics()
        cache = CacheManager(self.model.config, loaded.device, loaded.dtype, loaded.max_context, CacheConfig(budget_bytes=2**31), metrics=self.metrics)
        self.engine = Engine(self.model, self.tokenizer, EngineConfig(max_context=loaded.max_context, **engine_kw), cache, metrics=self.metrics)
        self.engine.start()

    def prompt(self, text, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def run(self, request, cancel_after=None):
        return await engines.run(self.engine, request, cancel_after)

    def gauge(self, name, **labels):
        return self.metrics.registry.get_sample_value(name, labels)

    def check_equivalent(self, request, tokens, want):
        assert_equivalent(self.model, request.prompt_ids, tokens, want, request.grammar)

    def stop(self):
        self.engine.stop()


@pytest.fixture
def bench(smollm2):
    yield from stopped_after(lambda **kw: Bench(smollm2, **kw))


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def mixed_requests(b: Bench, compiler) -> list[GenerationRequest]:
    """18 sequences: short and long prompts, 3..40 tokens, 4 session turns (reusing a first turn
    run earlier), 3 structured, a seeded sample, and one request with n=2 (two rows)."""
    pet = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}, None))
    reqs = []
    for i, topic in enumerate(TOPICS):
        reqs.append(GenerationRequest(f"plain-{i}", b.prompt(f"Write two sentences about {topic}."), greedy(3 + 4 * i)))
    reqs.append(GenerationRequest("long", b.prompt("What does note 17 list?", system=LONG_DOC), greedy(12)))
    for i in range(4):
        reqs.append(GenerationRequest(f"turn2-{i}", b.prompt(f"And now about {TOPICS[i]} at night?", system=f"Session {i}."), greedy(10 + i), session_id=f"s{i}"))
    for i in range(3):
        reqs.append(GenerationRequest(f"json-{i}", b.prompt(f"Describe pet number {i} as JSON."), greedy(40), grammar=pet))
    reqs.append(GenerationRequest("seeded", b.prompt("Invent a word."), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)))
    # n=2 as serving builds it: the first choice may use a session, the second has its own cache
    for j in range(2):
        reqs.append(GenerationRequest(f"n2-{j}", b.prompt("Name a color."), greedy(8), use_session=j == 0))
    return reqs


@pytest.mark.parametrize("paged, fast", [(False, False), (True, False), (True, True)], ids=["rows", "paged", "paged-compiled"])
def test_concurrent_mixed_requests_equal_each_run_alone(bench, compiler, paged, fast):
    """`paged`: the attention path CUDA takes (decode rows bucket-padded from the persistent
    buffers, multi-token rows in padded batches), run eagerly on this device; `fast`: as a GPU
    serves, the forward compiled (decode steps, and the steps of prefill chunks, forced tokens
    and decode rows together) and each decode step launched before the last one's tokens reach
    the host."""
    fast_kw = {"compile": "require", "overlap": True} if fast else {}
    if fast:  # dynamo's recompile limit is per code object: other tests' Llamas compiled in this process count
        torch._dynamo.reset()
    b = bench(max_batch_tokens=128, paged=paged, **fast_kw)  # the long prompt prefills in chunks beside decoding rows
    if fast:
        assert b.engine.runner.paths["compile"] == "decode+mixed" and b.engine.runner.paths["overlap"] == "on"

    async def go():
        for i in range(4):  # first turns, so the batched second turns reuse their sessions
            await b.run(GenerationRequest(f"turn1-{i}", b.prompt(f"Tell me about {TOPICS[i]}.", system=f"Session {i}."), greedy(4), session_id=f"s{i}"))
        reqs = mixed_requests(b, compiler)
        together = await asyncio.gather(*(b.run(r) for r in reqs))
        alone = []
        for r in reqs:
            solo = GenerationRequest(r.request_id + "-alone", r.prompt_ids, r.params, grammar=r.grammar, use_session=False)
            alone.append(await b.run(solo))
        return reqs, together, alone

    reqs, together, alone = asyncio.run(go())
    identical = 0
    for r, (tokens, final), (want, want_final) in zip(reqs, together, alone):
        assert final.finish_reason == want_final.finish_reason in ("stop", "length"), r.request_id
        if tokens == want:
            identical += 1
            continue
        assert r.params.greedy, f"seeded sample {r.request_id} changed with the batch: {tokens} != {want}"
        b.check_equivalent(r, tokens, want)
    print(f"\nbatched vs alone: {identical}/{len(reqs)} outputs token-identical")
    assert len(reqs) >= 16
    finals = {r.request_id: f for r, (_, f) in zip(reqs, together)}
    assert all(finals[f"turn2-{i}"].cached_tokens > 0 for i in range(4))  # reuse under batching
    for r, (tokens, final) in zip(reqs, together):
        if r.grammar is not None and final.finish_reason == "stop":
            jsonschema.validate(json.loads(b.tokenizer.decode(tokens, skip_special_tokens=True)), PET)
    # one forward pass carried many rows and a prefill chunk beside decode rows
    steps, rows = b.gauge("kvserve_batch_rows_count"), b.gauge("kvserve_batch_rows_sum")
    assert steps > b.gauge("kvserve_batch_rows_bucket", le="1.0") and rows / steps > 1.5
    assert b.gauge("kvserve_requests_running") == 0 and b.gauge("kvserve_requests_waiting") == 0


def test_cancel_and_timeout_of_one_row_leave_the_others_untouched(bench):
    b = bench()

    async def go():
        reqs = [GenerationRequest(f"r{i}", b.prompt(f"Write a long story about {t}."), greedy(24)) for i, t in enumerate(TOPICS[:5])]
        endless = SamplingParams(max_tokens=200, temperature=0.0, logit_bias={b.tokenizer.eos_token_id: -100.0})
        victim = GenerationRequest("victim", b.prompt("Count slowly to one hundred."), endless)
        late = GenerationRequest("late", b.prompt("Count slowly to two hundred."), endless, timeout_s=1.5)
        results = await asyncio.gather(*(b.run(r) for r in reqs), b.run(victim, cancel_after=3), b.run(late))
        alone = [await b.run(GenerationRequest(r.request_id + "-alone", r.prompt_ids, r.params)) for r in reqs]
        return reqs, results, alone

    reqs, results, alone = asyncio.run(go())
    *survivors, (v_tokens, v_final), (l_tokens, l_final) = results
    assert v_final.finish_reason == "abort" and 3 <= len(v_tokens) < 200
    assert l_final.finish_reason == "error" and l_final.error == "timeout" and len(l_tokens) < 200
    for r, (tokens, final), (want, _) in zip(reqs, survivors, alone):
        assert final.finish_reason == "length"
        b.check_equivalent(r, tokens, want)
    assert b.gauge("kvserve_requests_running") == 0 and b.gauge("kvserve_requests_waiting") == 0
    assert b.gauge("kvserve_kv_cache_bytes_used") == b.engine.cache_manager.store.used_bytes  # no private cache left


def test_a_seeded_request_draws_the_same_tokens_whatever_else_runs(bench):
    b = bench()
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=99)

    async def go():
        prompt = b.prompt("Say something surprising.")
        alone = await b.run(GenerationRequest("alone", prompt, params))
        crowd = [GenerationRequest(f"c{i}", b.prompt(f"Talk about {t}."), SamplingParams(max_tokens=20, temperature=1.0)) for i, t in enumerate(TOPICS[:6])]
        together = await asyncio.gather(b.run(GenerationRequest("together", prompt, params)), *(b.run(r) for r in crowd))
        return alone, together[0]

    (alone, _), (together, _) = asyncio.run(go())
    assert together == alone
