"""Session KV reuse on the real model: every turn's greedy output with reuse is token-identical
to a fresh prefill of the same prompt (docs/architecture.md, "Equivalence"), and cached_tokens is exactly
the common prefix of the session's committed tokens and the new prompt."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from cache_manager.prefix import common_prefix_len
from server.engine.core import Engine, EngineConfig, SessionBusy
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from tests.device import DEVICE, DTYPE
from tests.equivalence import assert_equivalent
from tests import engines
from tests.engines import stopped_after

TOPICS = ["the sea", "mountains", "a cat", "bread", "rain", "trains", "chess", "the moon", "coffee", "winter"]


class Harness:
    """One engine over one model; remembers each session's committed tokens to predict reuse."""

    def __init__(self, model, tokenizer, max_context, budget=2**31, ttl_s=1800.0, tiers=None, metrics=None, kv_dtype="auto", **engine_kw):
        self.model, self.tokenizer = model, tokenizer
        config = CacheConfig(budget_bytes=budget, ttl_s=ttl_s, kv_dtype=kv_dtype)
        self.cache = CacheManager(model.config, model.device, model.dtype, max_context, config, metrics, **(tiers or {}))
        self.engine = Engine(model, tokenizer, EngineConfig(max_context=max_context, **engine_kw), self.cache)
        self.engine.start()
        self.committed: dict[str, list[int]] = {}

    def prompt(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def generate(self, prompt, session=None, max_tokens=6, private=False, principal="alice", cancel_after=None):
        request = GenerationRequest(
            f"r-{session}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
            principal=principal, session_id=session, use_session=not private,
        )
        return await engines.run(self.engine, request, cancel_after)

    async def turn(self, session, prompt, max_tokens=6, reference=None):
        """A reused turn and its fresh reference (on `reference`, default this engine, in a
        private cache); checks equivalence and cached_tokens."""
        (got, final), (want, _) = await asyncio.gather(
            self.generate(prompt, session, max_tokens),
            (reference or self).generate(prompt, None, max_tokens, private=True),
        )
        self.check_equivalent(prompt, got, want)
        expected = min(common_prefix_len(self.committed.get(session, []), prompt), len(prompt) - 1)
        assert final.cached_tokens == expected, (session, final.cached_tokens, expected, final.miss_reason)
        self.record(session, prompt, got, final)
        return got, final

    def record(self, session, prompt, tokens, final):
        # the engine commits what is in the cache: an end-of-turn token is never computed, a
        # last token cut by max_tokens is sampled but not yet computed either
        self.committed[session] = prompt + (tokens if final.finish_reason == "stop" else tokens[:-1])

    def check_equivalent(self, prompt, got, want):
        assert_equivalent(self.model, prompt, got, want)

    def reply(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stop(self):
        self.engine.stop()


@pytest.fixture
def harness(smollm2):
    yield from stopped_after(lambda **kw: Harness(smollm2.model, smollm2.tokenizer, smollm2.max_context, **kw))


def conversation_start(i: int) -> list[dict]:
    # mixed lengths: every fourth conversation carries a long document, so its cache outgrows
    # the first 256-token bucket in the middle of the conversation
    doc = " ".join(f"Fact {k}: {TOPICS[(i + k) % 10]} is item {k}." for k in range(30 if i % 4 == 0 else 2))
    return [{"role": "system", "content": f"You are assistant {i}. {doc}"}]


def test_twenty_interleaved_conversations_match_fresh_prefill(harness):
    h = harness(max_running=16)
    convs = {f"conv{i}": conversation_start(i) for i in range(20)}

    async def play():
        for turn in range(4):
            prompts = {}
            for i, (sid, messages) in enumerate(convs.items()):
                messages.append({"role": "user", "content": f"Turn {turn}: tell me about {TOPICS[(i + turn) % 10]}."})
                prompts[sid] = h.prompt(messages)
            results = await asyncio.gather(*(h.turn(sid, p) for sid, p in prompts.items()))
            for (sid, messages), (tokens, final) in zip(convs.items(), results):
                messages.append({"role": "assistant", "content": h.reply(tokens)})
                if turn > 0:
                    assert final.cached_tokens > 0, sid

    asyncio.run(play())
    long_session = h.cache.store.get(("alice", "conv0"))
    assert kv.capacity(long_session.kv) > 256  # grew past its first bucket mid-conversation


def test_edit_regenerate_and_abort(harness):
    h = harness()
    messages = conversation_start(1) + [{"role": "user", "content": "Name a fruit."}]

    async def play():
        tokens, _ = await h.turn("s", h.prompt(messages))
        messages.append({"role": "assistant", "content": h.reply(tokens)})
        messages.append({"role": "user", "content": "And a vegetable?"})
        await h.turn("s", h.prompt(messages))
        # regenerate the last turn: the same prompt again reuses all but its last token
        _, final = await h.turn("s", h.prompt(messages))
        assert final.cached_tokens == len(h.prompt(messages)) - 1
        # edit an earlier turn: reuse stops where the history changed
        edited = [dict(m) for m in messages]
        edited[1]["content"] = "Name a color."
        _, final = await h.turn("s", h.prompt(edited))
        assert 0 < final.cached_tokens < len(h.prompt(edited)) - 10
        # an aborted turn, then a new one: the session rolls back to what was not overwritten
        longer = edited + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Why is the sky blue? Explain."}]
        reused_before_abort = min(common_prefix_len(h.committed["s"], h.prompt(longer)), len(h.prompt(longer)) - 1)
        _, final = await h.generate(h.prompt(longer), "s", max_tokens=50, cancel_after=2)
        assert final.finish_reason == "abort"
        assert final.cached_tokens == reused_before_abort
        h.committed["s"] = h.prompt(longer)[:reused_before_abort]
        await h.turn("s", h.prompt(longer))

    asyncio.run(play())


def one_session(loaded) -> int:
    """A budget that holds any one of these short conversations (<= 7 blocks: 93 tokens at
    their third turn, max_tokens included) but never two (>= 4 blocks each)."""
    return kv.bytes_for(loaded.model.config, 7 * kv.BLOCK_SIZE, loaded.dtype)


def test_eviction_between_turns_recomputes_transparently(harness, smollm2):
    h = harness(budget=one_session(smollm2))
    reference = harness()  # fresh prefills on their own engine: they must not evict here

    async def play():
        convs = {sid: conversation_start(k) for k, sid in [(1, "a"), (2, "b")]}
        for turn in range(3):
            for sid, messages in convs.items():
                messages.append({"role": "user", "content": f"Question {turn}?"})
                prompt = h.prompt(messages)
                if turn > 0:
                    h.committed[sid] = []  # the other session evicted this one meanwhile
                tokens, final = await h.turn(sid, prompt, reference=reference)
                assert final.miss_reason == ("new_session" if turn == 0 else "evicted")
                messages.append({"role": "assistant", "content": h.reply(tokens)})

    asyncio.run(play())
    assert h.cache.store.drop_counts["evicted"] >= 4


def test_ttl_expiry_is_a_transparent_miss(harness):
    h = harness(ttl_s=0.2, expire_every_s=0.05)

    async def play():
        prompt = h.prompt(conversation_start(2) + [{"role": "user", "content": "Hi"}])
        await h.turn("t", prompt)
        await asyncio.sleep(0.5)
        h.committed["t"] = []
        _, final = await h.turn("t", prompt)
        assert final.miss_reason == "expired" and final.cached_tokens == 0

    asyncio.run(play())


def test_one_request_at_a_time_per_session(harness):
    h = harness()
    prompt = h.prompt(conversation_start(3) + [{"role": "user", "content": "Count to ten."}])

    async def play():
        first, second = await asyncio.gather(h.generate(prompt, "busy", 12), h.generate(prompt, "busy", 12))
        assert first[0] == second[0]  # neither saw the other's tokens in its cache
        # the second waited for the first, then reused its prompt
        assert sorted([first[1].cached_tokens, second[1].cached_tokens]) == [0, len(prompt) - 1]

    asyncio.run(play())
    strict = harness(reject_busy_sessions=True)

    async def refused():
        loop = asyncio.get_running_loop()
        request = lambda: GenerationRequest("x", prompt, SamplingParams(max_tokens=30, temperature=0), session_id="busy")  # noqa: E731
        handle = strict.engine.submit(request(), loop)
        with pytest.raises(SessionBusy):
            strict.engine.submit(request(), loop)
        async for _ in handle:
            pass

    asyncio.run(refused())


def test_anonymous_reuse_stays_within_a_principal(harness):
    h = harness()
    prompt = h.prompt(conversation_start(5) + [{"role": "user", "content": "Hello there"}])

    async def play():
        _, first = await h.generate(prompt, None, principal="alice")
        _, again = await h.generate(prompt, None, principal="alice")
        _, other = await h.generate(prompt, None, principal="bob")
        _, named = await h.generate(prompt, "alice-session", principal="bob")
        return first, again, other, named

    first, again, other, named = asyncio.run(play())
    # anonymous reuse of another request's entry stops at a whole block of 32 tokens
    assert first.cached_tokens == 0 and again.cached_tokens == (len(prompt) - 1) // 32 * 32 > 0
    assert other.cached_tokens == 0 and named.cached_tokens == 0


def sliding_model():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=48, max_position_embeddings=2048, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()


def test_sliding_window_shorter_than_the_conversation(smollm2):
    h = Harness(sliding_model(), smollm2.tokenizer, 2048)
    try:
        async def play():
            # Each turn extends the committed tokens exactly (a random model's replies do not
            # survive a decode/encode round trip, so the chat template would diverge).
            first = h.prompt([{"role": "user", "content": "Start of a conversation that is long enough."}])
            prompt = first
            for turn in range(4):
                _, final = await h.turn("w", prompt, max_tokens=8)
                if turn > 0:
                    assert final.cached_tokens == len(h.committed_before)
                h.committed_before = h.committed["w"]
                prompt = h.committed["w"] + h.tokenizer(f" More please, part {turn}.", add_special_tokens=False)["input_ids"]
            assert len(h.committed["w"]) > 48  # the window has wrapped
            # an edit inside the wrapped window: the pool keeps every position, so it crops
            edited = prompt[:5] + h.tokenizer(" a different middle", add_special_tokens=False)["input_ids"] + prompt[9:]
            _, final = await h.turn("w", edited, max_tokens=8)
            assert final.miss_reason is None and final.cached_tokens >= 5
            # and a new extension of the new state reuses again
            h.committed_before = h.committed["w"]
            _, final = await h.turn("w", h.committed["w"] + [260, 261, 262], max_tokens=8)
            assert final.cached_tokens == len(h.committed_before)

        asyncio.run(play())
    finally:
        h.stop()
