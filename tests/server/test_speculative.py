"""Speculative decoding (server/engine/speculative.py, server/engine/draft_model.py): the accept/reject rules
and the draft-length choice without a model; then the engine on the real SmolLM2 model, where
every greedy output with speculation equals the output without it (docs/architecture.md's
rule: token-identical, or the first differing step is a near-tie) for prompt lookup, a draft
model that is always right (SmolLM2 itself) and one that is mostly wrong (a tiny random model),
with sessions, n > 1, grammars, logprobs, stop strings and max_tokens; a sliding-window model
drafts past its window; the HTTP opt-out and the metrics."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from server.engine import attention, cpu_linear
from grammars import GrammarCompiler, spec_from_request
from server.startup import build_context
from server.engine.draft_model import DraftModelProposer
from server.engine.core import Engine, EngineConfig
from server.metrics import Metrics
from server.engine.sampler import accept_greedy, accept_or_resample, accept_point_mass
from server.engine.sampling import SamplingParams, make_generator, sample_rows
from server.engine.scheduler import Plan, ScheduledRow
from server.engine.sequence import GenerationRequest, Status
from server.settings import Settings
from server.engine.prompt_lookup import NgramProposer
from server.engine.speculative import (
    Draft,
    SharedAcceptance,
    SpeculativeConfig,
    Speculator,
    SpecState,
    StepCost,
    allocate,
    expected_tokens,
)
from tests.device import DEVICE, DTYPE, cpu_only
from tests.equivalence import assert_equivalent
from tests.engines import stopped_after
from tests.server.test_api import MODEL, sample

CODE = '''def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
DRAFTED, ACCEPTED = "kvserve_spec_decode_draft_tokens_total", "kvserve_spec_decode_accepted_tokens_total"
COPY_PROMPTS = [
    "Rename cheapest to lowest in this code and reply with the code only:\n" + CODE,
    "Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, figs.",
    "Copy this sentence twice: the harbor ledger lists seven crates of copper.",
]
TICKET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "order": {"type": "string", "maxLength": 12},
                   "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "order", "city"],
    "additionalProperties": False,
}
EMAIL = "From Maria Lindqvist about order A-48213, delivered to Bergen: the kettle is broken."


# -- the rules, no model ---------------------------------------------------------------------------


def test_greedy_rule_accepts_exactly_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9], device=DEVICE)
    assert accept_greedy(logits, 1) == (True, 1)
    assert accept_greedy(logits, 3) == (False, 1)


P = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05], device=DEVICE)
Q = torch.tensor([0.1, 0.2, 0.4, 0.05, 0.25], device=DEVICE)
# NOTE: the test's own draws go through .cpu(): requests' generators are CPU ones (make_generator)


def test_sampling_rules_keep_the_target_distribution():
    """The standard rule on a 5-token vocabulary, 40k draws with a fixed seed: whatever the
    draft distribution (or a fixed draft token), the emitted token is distributed as p, and
    the acceptance rate is sum(min(p, q)) (p(x) for a fixed draft x)."""
    g = make_generator(7)
    n = 40_000
    counts, accepted = torch.zeros(5, device=DEVICE), 0
    for _ in range(n):
        x = int(torch.multinomial(Q.cpu(), 1, generator=g))
        ok, token = accept_or_resample(P, Q, x, g)
        counts[token] += 1
        accepted += ok
    assert torch.allclose(counts / n, P, atol=0.01), counts / n
    assert abs(accepted / n - float(torch.minimum(P, Q).sum())) < 0.01
    counts, accepted = torch.zeros(5, device=DEVICE), 0
    for _ in range(n):
        ok, token = accept_point_mass(P, 2, g)
        counts[token] += 1
        accepted += ok
    assert torch.allclose(counts / n, P, atol=0.01) and abs(accepted / n - 0.15) < 0.01


def verifier():
    return Speculator(NgramProposer(), eos_ids=frozenset())


def fake_seq(params, seed):
    return SimpleNamespace(params=params, generator=make_generator(seed), counts=None, matcher=None, grammar=None,
                           reasoning=None, spec=SpecState(), all_ids=[0], request_id="fake")


def test_verify_keeps_the_joint_distribution_of_consecutive_tokens():
    """`Speculator.verify` over a two-token draft from a draft distribution, on a 'model' whose
    next-token distribution is always p: the first two emitted tokens are independent draws
    from p (pairs of the 5 x 5 outcomes within 0.012 of p x p over 30k runs)."""
    speculator, logits = verifier(), torch.log(P).repeat(3, 1)
    params = SamplingParams(max_tokens=8, temperature=1.0)
    g = make_generator(11)
    n, pairs = 30_000, torch.zeros(5, 5, device=DEVICE)
    seq = fake_seq(params, 3)
    for _ in range(n):
        draft = [int(torch.multinomial(Q.cpu(), 1, generator=g)) for _ in range(2)]
        tokens, accepted = speculator.verify(seq, Draft(draft, probs=Q.repeat(2, 1)), logits.clone())
        if len(tokens) == 1:  # rejected at once: the second token is a plain draw
            tokens.append(SimpleNamespace(token_id=int(torch.multinomial(P.cpu(), 1, generator=g))))
        pairs[tokens[0].token_id, tokens[1].token_id] += 1
    assert torch.allclose(pairs / n, P[:, None] * P[None, :], atol=0.012)


def test_prompt_lookup_sampling_draws_what_decoding_without_a_draft_draws():
    """A deterministic draft under sampling: one draw per emitted token from the request's
    generator, the very draw decoding without speculation makes (same seed, same tokens)."""
    speculator, logits = verifier(), torch.log(P).repeat(4, 1)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9)
    for seed in range(20):
        draft = [0, 0, 1]
        tokens, accepted = speculator.verify(fake_seq(params, seed), Draft(draft), logits.clone())
        plain_generator = make_generator(seed)
        want = [sample_rows(logits[:1].clone(), [params], [plain_generator])[0] for _ in range(4)]
        agree = next((j for j in range(3) if want[j] != draft[j]), 3)
        assert accepted == agree and [t.token_id for t in tokens] == want[: agree + 1]


def test_draft_lengths_follow_acceptance_and_cost():
    flat = lambda n: 1.0 + 0.01 * n  # noqa: E731  an extra token costs 1% of a step
    ks = allocate([0.9, 0.2, 0.0], [8, 8, 8], 3, flat, budget=100)
    assert ks[0] == 8 and 0 < ks[1] < 4 and ks[2] == 0
    assert allocate([0.9], [8], 1, lambda n: 1.0 + 1.0 * n, budget=100) == [0]  # tokens too dear
    assert allocate([0.9], [8], 1, flat, budget=3) == [3]  # the step's token budget
    many = allocate([0.6] * 16, [8] * 16, 16, lambda n: 1.0 + 0.06 * (16 + n), budget=1000)
    assert sum(many) < allocate([0.6], [8], 1, lambda n: 1.0 + 0.06 * (1 + n), budget=1000)[0] * 16
    assert expected_tokens(0.5, 2) == 1.75


def test_step_cost_interpolates_measured_sizes():
    cost = StepCost()
    for _ in range(3):
        cost.observe(1, 0.050)
        cost.observe(9, 0.090)
    cost.observe(1, 5.0)  # one noisy outlier does not move the median
    assert cost.seconds(1) == 0.050 and math.isclose(cost.seconds(5), 0.070)
    assert cost.seconds(18) > 0.090  # past the largest measured size: dearer, never free


def test_step_cost_never_falls_as_the_step_grows():
    """Noisy medians (one extraction run's, in ms) where bigger steps measured cheaper: the
    cost stays non-decreasing, so more drafted tokens never look cheaper than fewer; where
    the order holds, the medians are kept."""
    cost = StepCost()
    for n, ms in ((4, 46), (6, 56), (7, 52), (8, 58), (9, 53), (10, 59), (16, 72), (18, 70)):
        cost.observe(n, ms / 1000)
    curve = [cost.seconds(n) for n in range(1, 40)]
    assert all(a <= b for a, b in zip(curve, curve[1:])), curve
    assert cost.seconds(4) == 0.046 and cost.seconds(10) == 0.059
    assert math.isclose(cost.seconds(6), 0.054) and math.isclose(cost.seconds(8), 0.0555)
    for _ in range(3):  # three more samples of 18: pooled with 16 by their weight, 4 to 1
        cost.observe(18, 0.070)
    assert math.isclose(cost.seconds(16), (0.072 + 4 * 0.070) / 5) and cost.seconds(16) == cost.seconds(18)


def test_ngram_proposer_drafts_what_followed_the_latest_longest_match():
    """No prompt to resume (below): the latest occurrence of the longest match."""
    proposer = NgramProposer(min_n=2, max_n=3)
    seq = SimpleNamespace(prompt_ids=[], all_ids=[5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7], spec=SpecState())
    assert proposer.limit(seq, 5) == 4  # [6, 7] last seen at 6..7, then 2, 3, 6, 7
    assert proposer.propose([seq], [3])[0].tokens == [2, 3, 6]
    seq.all_ids += [2]  # now [6, 7, 2] matches, the longest first
    assert proposer.limit(seq, 2) == 2 and proposer.propose([seq], [2])[0].tokens == [3, 6]
    seq.all_ids += [4]
    assert proposer.limit(seq, 4) == 0


def test_ngram_proposer_resumes_the_prompt_in_order_after_the_reply_departs_from_it():
    """Three "functions" starting alike: the reply copies the first, writes its own second one,
    then starts the next: the draft resumes the prompt past what was copied (the second
    function), not at the latest occurrence (the reply's own first lines)."""
    proposer = NgramProposer(min_n=2, max_n=2)
    prompt = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 31]
    seq = SimpleNamespace(prompt_ids=prompt, all_ids=prompt + [1, 2], spec=SpecState())
    assert proposer.limit(seq, 2) == 2 and proposer.propose([seq], [2])[0].tokens == [10, 11]
    seq.all_ids += [10, 11]  # copied
    assert proposer.limit(seq, 2) == 2 and proposer.propose([seq], [2])[0].tokens == [1, 2]
    seq.all_ids += [40, 41]  # its own
    assert proposer.limit(seq, 2) == 0
    seq.all_ids += [1, 2]
    assert proposer.limit(seq, 4) == 4 and proposer.propose([seq], [4])[0].tokens == [20, 21, 1, 2]


def test_acceptance_is_kept_apart_for_each_source():
    """Drafts copied from the prompt and from the reply's own earlier text succeed at different
    rates (an extraction copies values from its document, while what follows a JSON key earlier
    in the reply is another key's value): misses of one source do not shorten the other's
    drafts, and a skipped draft's free observation counts for the source it would have had."""
    spec = SpecState()
    spec.source = "output"
    for _ in range(4):
        spec.record(6, 0)
    spec.source = "prompt"
    assert spec.alpha == 0.5  # untouched: the prior
    spec.record(6, 6)
    prompt_alpha = spec.alpha
    spec.source = "output"
    assert spec.alpha < 0.5 < prompt_alpha
    spec.shadow = (3, 42, "prompt")  # would have drafted 42 at position 3, from the prompt
    spec.settle_shadow([0, 0, 0, 7])  # it was not 42
    assert spec.rates.counts["prompt"][1] > 0.85 and spec.drafted == 30 and spec.accepted == 6
    spec.source = "prompt"
    assert spec.alpha < prompt_alpha


def test_a_new_sequence_starts_from_the_engines_acceptance_for_each_source():
    """Sequences share what they learn (slowly decayed): a new one's first drafts from the
    prompt are as long as the prompt's copies have been accepted lately, its drafts from its
    own output as short; its own observations then take over."""
    shared = SharedAcceptance()
    first = SpecState(shared=shared)
    for _ in range(5):
        first.source = "prompt"
        first.record(8, 8)
        first.source = "output"
        first.record(4, 0)
    second = SpecState(shared=shared)
    second.source = "prompt"
    assert second.alpha > 0.8 and SpecState().alpha == 0.5
    second.source = "output"
    assert second.alpha < 0.3
    for _ in range(3):
        second.record(4, 4)
    assert second.alpha > 0.7


def test_a_low_shared_rate_cannot_stop_drafting_for_good():
    """A draft model's rows that do not draft observe nothing (no free first token): steps
    without drafts pull both the sequence's rate and the shared one back to an even guess,
    so a new sequence after a bad spell drafts again."""
    shared = SharedAcceptance()
    for _ in range(60):
        SpecState(shared=shared).record(4, 0)
    waiting = SpecState(shared=shared)
    assert waiting.alpha < 0.1
    for _ in range(100):
        waiting.relax()
    assert SpecState(shared=shared).alpha > 0.45


def test_the_engine_starts_each_sequence_from_what_the_others_learned():
    """`Speculator.draft` gives every new sequence the engine's shared rates: once a sequence's
    copies of its prompt were all accepted, the next sequence's first copy of its own prompt
    is drafted longer than from an even start."""
    speculator = Speculator(NgramProposer(), eos_ids=frozenset())

    def decoding(prompt):  # a sequence whose last token occurs at the start of its prompt
        cache = kv.allocate(LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=4,
                                        vocab_size=8, max_position_embeddings=2048), 1024, DEVICE, torch.float32)
        cache.length = len(prompt) + 1
        seq = SimpleNamespace(status=Status.DECODE, num_pending=1, request=SimpleNamespace(speculative=True, images=()),
                              params=SamplingParams(max_tokens=64), generated=[], spec=None, matcher=None, reasoning=None,
                              cache=cache, prompt_ids=prompt, all_ids=prompt + prompt[:1])
        return ScheduledRow(seq, 1)

    first = decoding(list(range(100, 140)))
    speculator.draft(Plan([first]), 512)
    from_even_start = first.n_draft
    assert first.seq.spec.source == "prompt" and 0 < from_even_start < 15
    for _ in range(6):
        first.seq.spec.record(8, 8)
    second = decoding(list(range(200, 240)))
    speculator.draft(Plan([second]), 512)
    assert second.n_draft > from_even_start
    greedy = decoding(list(range(300, 340)))  # greedy requests accept otherwise: their own rates
    greedy.seq.params = SamplingParams(max_tokens=64, temperature=0.0)
    speculator.draft(Plan([greedy]), 512)
    assert greedy.n_draft == from_even_start


def test_ngram_proposer_names_where_its_draft_comes_from():
    proposer = NgramProposer(min_n=1, max_n=2)
    prompt = [1, 2, 3, 4]
    seq = SimpleNamespace(prompt_ids=prompt, all_ids=prompt + [2], spec=SpecState())
    assert proposer.limit(seq, 2) == 2 and seq.spec.source == "prompt"
    seq.all_ids += [9, 8, 9]  # 9 last seen in the reply, followed by 8
    assert proposer.limit(seq, 2) == 2 and seq.spec.source == "output"
    assert proposer.propose([seq], [2])[0].tokens == [8, 9]
    seq = SimpleNamespace(prompt_ids=prompt, all_ids=prompt + [4], spec=SpecState())
    assert proposer.limit(seq, 2) == 1 and seq.spec.source == "output"  # the match ends the prompt: the draft is the reply's


# -- the engine on the real model --------------------------------------------------------------


class Spec:
    """One engine with a proposer (drafting whenever it can, unless `adaptive`) and metrics;
    records each step's drafts."""

    def __init__(self, loaded, proposer=None, adaptive=False, model=None, max_draft=8, **engine_kw):
        self.model, self.tokenizer = model or loaded.model, loaded.tokenizer
        self.metrics = Metrics()
        cache = CacheManager(self.model.config, loaded.device, loaded.dtype, 2048, CacheConfig(budget_bytes=2**31), metrics=self.metrics)
        config = EngineConfig(max_context=2048, speculative=SpeculativeConfig(max_draft=max_draft, adaptive=adaptive), **engine_kw)
        self.engine = Engine(self.model, self.tokenizer, config, cache, metrics=self.metrics, proposer=proposer or NgramProposer())
        self.steps: list[list[tuple[int, int]]] = []  # per step: (cache length, drafted) of rows with drafts
        self.pending: list[int] = []  # the pending tokens of each row that drafted (a forced run: > 1)
        draft = self.engine.speculator.draft

        def spy(plan, budget):
            draft(plan, budget)
            self.steps.append([(kv.length(r.seq.cache), r.n_draft) for r in plan.rows if r.n_draft])
            self.pending += [r.n_tokens for r in plan.rows if r.n_draft]

        self.engine.speculator.draft = spy
        self.engine.start()

    def prompt(self, text):
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def run(self, request):
        tokens, infos, text, final = [], [], "", None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            tokens += [t.token_id for t in out.tokens]
            infos += out.tokens
            text += out.text
            final = out
        return SimpleNamespace(tokens=tokens, infos=infos, text=text, final=final)

    def counter(self, name):
        return self.metrics.registry.get_sample_value(name) or 0.0

    def stop(self):
        self.engine.stop()


@pytest.fixture
def spec(smollm2):
    yield from stopped_after(lambda **kw: Spec(smollm2, **kw))


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def plain(request, **changes):
    """The same request without speculation, in a private cache (the reference)."""
    fields = {f: getattr(request, f) for f in ("prompt_ids", "params", "grammar", "principal")}
    fields.update(changes)
    return GenerationRequest(request.request_id + "-plain", use_session=False, speculative=False, **fields)


def check(s: Spec, request, got, want, tally):
    assert got.final.finish_reason == want.final.finish_reason, request.request_id
    assert_equivalent(s.model, request.prompt_ids, got.tokens, want.tokens, request.grammar)
    tally.append(got.tokens == want.tokens)


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_prompt_lookup_greedy_equals_no_speculation_with_sessions_and_n(spec, paged):
    """Copy-heavy prompts drafting every step they can, three interleaved sessions over two
    turns (the second reusing the first's KV, cropped drafts included), and n = 2 as serving
    builds it; rows in one step draft different numbers of tokens. `paged`: the attention
    path CUDA takes (drafted rows in padded multi-token batches), run eagerly here."""
    s = spec(paged=paged)
    tally = []

    async def go():
        turn1 = [GenerationRequest(f"s{i}-1", s.prompt(t), greedy(28), session_id=f"s{i}") for i, t in enumerate(COPY_PROMPTS)]
        n2 = [GenerationRequest(f"n2-{j}", s.prompt(COPY_PROMPTS[1]), greedy(12 + 8 * j), use_session=j == 0) for j in range(2)]
        got = await asyncio.gather(*(s.run(r) for r in turn1 + n2))
        want = [await s.run(plain(r)) for r in turn1 + n2]
        for r, g, w in zip(turn1 + n2, got, want):
            check(s, r, g, w, tally)
        more = s.tokenizer("<|im_end|>\n<|im_start|>user\nOnce more, please.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        turn2 = [GenerationRequest(f"s{i}-2", r.prompt_ids + g.tokens + more, greedy(24), session_id=f"s{i}") for i, (r, g) in enumerate(zip(turn1, got))]
        got2 = await asyncio.gather(*(s.run(r) for r in turn2))
        for r, first, g in zip(turn2, turn1, got2):
            assert g.final.cached_tokens >= len(first.prompt_ids)  # the session's KV was reused
            check(s, r, g, await s.run(plain(r)), tally)

    asyncio.run(go())
    print(f"\nprompt lookup vs none: {sum(tally)}/{len(tally)} outputs token-identical, the rest near-ties")
    drafted, accepted = s.counter(DRAFTED), s.counter(ACCEPTED)
    assert drafted > 40 and 0 < accepted < drafted  # drafts were accepted and rejected (cropped)
    assert any(len({k for _, k in step}) > 1 for step in s.steps)  # rows with different drafts
    assert s.counter("kvserve_spec_decode_acceptance_rate_count") >= 5
    assert s.counter("kvserve_spec_decode_tokens_per_forward_sum") > s.counter("kvserve_spec_decode_tokens_per_forward_count")
    assert s.engine.idle and s.engine.cache_manager.store.used_bytes == s.metrics.registry.get_sample_value("kvserve_kv_cache_bytes_used")


def test_logprobs_stop_strings_max_tokens_and_seeded_sampling_match(spec):
    s = spec()
    ids = s.prompt(COPY_PROMPTS[1])

    async def go():
        full = await s.run(plain(GenerationRequest("f", ids, greedy(30))))
        stop = full.text[12:18]
        cases = [
            greedy(20, logprobs=True, top_logprobs=3),
            greedy(30, stop=(stop,)),
            greedy(5),
            greedy(30, frequency_penalty=0.5, logit_bias={11: 2.0}),
            SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=17),
        ]
        for i, params in enumerate(cases):
            request = GenerationRequest(f"c{i}", ids, params)
            got, want = await s.run(request), await s.run(plain(request))
            assert (got.tokens, got.text, got.final.finish_reason, got.final.completion_tokens) == (
                want.tokens, want.text, want.final.finish_reason, want.final.completion_tokens), params
            for a, b in zip(got.infos, want.infos):
                assert (a.logprob is None) == (b.logprob is None)
                if a.logprob is not None:
                    assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
        return stop

    stop = asyncio.run(go())
    assert stop and s.counter(ACCEPTED) > 0


def test_structured_output_with_drafts_is_valid_and_equal(spec, smollm2):
    """JSON from an email, and from JSON in the prompt, where the draft follows the keys the
    grammar forces (fast-forwarded, in the same forward pass as the draft)."""
    s = spec()
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    grammar = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "t", "schema": TICKET}}, None))
    prompts = [
        s.prompt("Extract name, order and city as JSON from: " + EMAIL),
        s.prompt('Repeat this JSON exactly: {"name": "Maria Lindqvist", "order": "A-48213", "city": "Bergen"}'),
    ]

    async def go():
        out = []
        for ids in prompts:
            for params in (greedy(60), greedy(60, logprobs=True)):  # with logprobs: no fast-forward
                request = GenerationRequest("j", ids, params, grammar=grammar)
                got, want = await s.run(request), await s.run(plain(request))
                assert got.final.finish_reason == "stop" and got.tokens == want.tokens
                out.append(json.loads(got.text))
        return out

    for value in asyncio.run(go()):
        jsonschema.validate(value, TICKET)
    assert s.counter(ACCEPTED) > 0
    assert any(n > 1 for n in s.pending)


def tiny_llama(seed):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2), dtype=DTYPE).to(DEVICE).eval()


def test_a_draft_model_right_or_wrong_never_changes_greedy_output(spec, smollm2):
    """SmolLM2 drafting for itself accepts every drafted token; a tiny random model with its
    vocabulary is nearly always rejected (each rejection cropped from both caches). Both
    outputs equal decoding without a draft; the second turn of a session reuses the kept
    draft cache."""
    tiny = tiny_llama(0)
    for draft_model, all_accepted in ((smollm2.model, True), (tiny, False)):
        proposer = DraftModelProposer(draft_model, 2048, budget_bytes=2**28)
        s = spec(proposer=proposer, max_draft=4)
        tally = []

        async def go():
            first = GenerationRequest("d1", s.prompt(COPY_PROMPTS[2]), greedy(20), session_id="d")
            got = await s.run(first)
            check(s, first, got, await s.run(plain(first)), tally)
            assert len(proposer._kept) == 1
            second = GenerationRequest("d2", first.prompt_ids + got.tokens + [2, 198, 1, 4093, 198], greedy(12), session_id="d")
            check(s, second, await s.run(second), await s.run(plain(second)), tally)

        asyncio.run(go())
        drafted, accepted = s.counter(DRAFTED), s.counter(ACCEPTED)
        assert drafted > 8 and (accepted == drafted if all_accepted else accepted < drafted / 2), (drafted, accepted)
        s.stop()


@cpu_only
@pytest.mark.parametrize("packed", [True, False])
def test_the_engine_thread_prepares_the_model_and_the_draft_model(smollm2, monkeypatch, packed):
    """Both models' CPU linear layers are packed on the engine thread, the only thread that
    runs multi-threaded torch ops (docs/architecture.md, "One OpenMP team"), not on the thread
    that builds the engine; then they serve as usual. With --no-cpu-packed-weights neither is
    packed (the dense weights only)."""
    packed_on = []
    pack = cpu_linear._pack
    monkeypatch.setattr(cpu_linear, "_pack", lambda layer: packed_on.append(threading.current_thread().name) or pack(layer))
    model, draft = tiny_llama(0), tiny_llama(1)
    cache = CacheManager(model.config, smollm2.device, smollm2.dtype, 2048, CacheConfig(budget_bytes=2**28))
    proposer = DraftModelProposer(draft, 2048, budget_bytes=2**26, packed=packed)
    config = EngineConfig(max_context=2048, cpu_packed_weights=packed)
    engine = Engine(model, smollm2.tokenizer, config, cache, proposer=proposer)
    assert not packed_on and model.config._attn_implementation != attention.ATTN_IMPLEMENTATION
    engine.start()
    try:
        async def go():
            request = GenerationRequest("t", [1, 4093, 198, 28, 29, 30], greedy(6, logit_bias={2: -100.0}))
            return [t.token_id for out in [o async for o in engine.submit(request, asyncio.get_running_loop())] for t in out.tokens]

        assert len(asyncio.run(go())) == 6
    finally:
        engine.stop()
    linear = [m for net in (model, draft) for m in net.modules() if type(m) is torch.nn.Linear]
    if packed:
        assert len(packed_on) == len(linear) and set(packed_on) == {"kvserve-engine"}
        assert all(hasattr(m, "kvserve_packed") for m in linear)
    else:
        assert not packed_on and not any(hasattr(m, "kvserve_packed") for m in linear)


def test_the_cpu_packed_weights_setting_reaches_the_model_and_the_draft_model(smollm2):
    for packed in (True, False):
        settings = Settings(speculative="draft", draft_model="unused: loaded below", cpu_packed_weights=packed)
        ctx = build_context(settings, smollm2, Metrics(), draft=smollm2)
        assert ctx.engine.config.cpu_packed_weights is packed and ctx.engine.speculator.proposer.packed is packed


def test_draft_caches_running_and_kept_stay_within_their_budget(spec, smollm2):
    """A budget of one draft cache: the next session's running draft cache evicts the kept one
    of the first session, whose next turn then drafts from scratch, output unchanged."""
    tiny = tiny_llama(0)
    prompt_a = Spec.prompt(smollm2, COPY_PROMPTS[0])
    # a's second turn (its first, 12 tokens and 5 more, then 8) fits; a's kept cache and b's
    # running one (the other prompt, 50+ tokens) do not fit together
    budget = kv.bytes_for(tiny.config, len(prompt_a) + 32, DTYPE)
    proposer = DraftModelProposer(tiny, 2048, budget_bytes=budget)
    used = []  # at every draft
    propose = proposer.propose
    proposer.propose = lambda seqs, ks: used.append(proposer.used_bytes()) or propose(seqs, ks)
    s = spec(proposer=proposer, max_draft=4)
    tally = []

    async def go():
        a = GenerationRequest("a1", prompt_a, greedy(12), session_id="a")
        got = await s.run(a)
        assert len(proposer._kept) == 1 and 0 < proposer.used_bytes() <= budget
        b = GenerationRequest("b1", s.prompt(COPY_PROMPTS[1]), greedy(12), session_id="b")
        check(s, b, await s.run(b), await s.run(plain(b)), tally)
        kept = proposer._kept.entries()
        assert len(kept) == 1 and kept[0].tokens[: len(b.prompt_ids)] == b.prompt_ids  # a's gave way
        again = GenerationRequest("a2", a.prompt_ids + got.tokens + [2, 198, 1, 4093, 198], greedy(8), session_id="a")
        check(s, again, await s.run(again), await s.run(plain(again)), tally)

    asyncio.run(go())
    assert used and max(used) <= budget
    s.stop()


def test_a_sliding_window_model_drafts_past_its_window(spec, smollm2):
    """Sliding layers keep every position in the pool, so rejected drafts crop past the window
    too: drafting goes on there, and the output is that of plain decoding."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=48, max_position_embeddings=2048, eos_token_id=2), dtype=DTYPE).to(DEVICE).eval()
    s = spec(model=model)
    ids = s.tokenizer("one two three one two three one two three one two", add_special_tokens=False)["input_ids"]
    request = GenerationRequest("w", ids, greedy(60, logit_bias={2: -100.0}))

    async def go():
        return await s.run(request), await s.run(plain(request))

    got, want = asyncio.run(go())
    assert got.tokens == want.tokens and len(ids) + 60 > 48
    drafts = [(length, k) for step in s.steps for length, k in step]
    assert any(length > 48 and k > 0 for length, k in drafts)  # drafts past the window


@pytest.mark.anyio
async def test_http_opt_out_and_metrics(app_client):
    async with app_client(speculative="ngram") as client:
        body = {"model": MODEL, "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": COPY_PROMPTS[1]}]}

        off = (await client.post("/v1/chat/completions", json={**body, "speculative": False})).json()
        assert sample((await client.get("/metrics")).text, DRAFTED) == 0
        on = (await client.post("/v1/chat/completions", json=body)).json()
        metrics = (await client.get("/metrics")).text
        assert sample(metrics, DRAFTED) > 0 and "kvserve_spec_decode_acceptance_rate_count 1.0" in metrics
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]


@pytest.mark.anyio
async def test_http_draft_model_from_a_directory(app_client, smollm2, tmp_path):
    """--speculative draft --draft-model DIR loads the draft like --model (here a tiny random
    model saved with SmolLM2's tokenizer), never changes the output, and takes its share of
    the KV budget."""
    torch.manual_seed(1)
    tiny = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2), dtype=torch.float32)
    tiny.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    async with app_client(speculative="draft", draft_model=str(tmp_path), kv_budget_bytes=2**30) as client:
        body = {"model": MODEL, "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": COPY_PROMPTS[2]}]}
        on = (await client.post("/v1/chat/completions", json=body)).json()
        off = (await client.post("/v1/chat/completions", json={**body, "speculative": False})).json()
        metrics = (await client.get("/metrics")).text
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
        assert sample(metrics, DRAFTED) > 0
        # the draft's caches take r / (1 + r) of the KV budget: r = 2 * 2 * 16 / (30 * 3 * 64) here
        r = (2 * 2 * 16) / (30 * 3 * 64)
        assert sample(metrics, "kvserve_kv_cache_bytes_budget") == 2**30 - int(2**30 * r / (1 + r))
