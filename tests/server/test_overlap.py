"""The overlap (server/engine/core.py `_launch_ahead`): a decode step launched before the
previous step's tokens reach the host (greedy rows' argmax and other rows' draws, chosen on the
device, under a grammar's mask or a thinking model's bans or not) gives the tokens, texts, finish reasons and sessions of an engine whose steps wait for
each other, with a stop at every position: a stop string, the end of max_tokens, a thinking
budget whose end marker the engine forces, a cancel. On CPU the steps do not run concurrently,
but every line of the overlap runs: the step launched ahead, its tokens taken on the device,
the rows it drops and the KV it crops."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from cache_manager.manager import CacheConfig, CacheManager
from cache_manager.sessions import Principal
from grammars import GrammarCompiler, spec_from_request
from server.engine.core import Engine, EngineConfig
from server.engine.reasoning import ReasoningSpec
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest, Status
from tests.equivalence import assert_equivalent

POSITIONS = range(1, 9)  # a stop at each of these generated tokens
PROMPTS = ["Name three rivers.", "What is a harbor?", "Count to five.", "Why is the sky blue?"]


class Engines:
    """The same model behind two paged engines, overlapping and not; counts what the overlap did.
    `forced_max`: `EngineConfig.overlap_forced_max` (default here: launch ahead however often
    tokens are forced, so that every path of the overlap runs)."""

    def __init__(self, loaded, max_context=None, forced_max=1.0):
        self.tokenizer = loaded.tokenizer
        self.engines = {}
        max_context = max_context or loaded.max_context
        for overlap in (True, False):
            cache = CacheManager(loaded.model.config, loaded.device, loaded.dtype, max_context, CacheConfig(budget_bytes=2**30))
            engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_context=max_context, paged=True, overlap=overlap,
                                                                         overlap_forced_max=forced_max), cache)
            engine.start()
            self.engines[overlap] = engine
        runner = self.engines[True].runner
        self.launched = 0
        self.constrained = 0  # steps launched ahead with a row under a grammar or bans
        self.forced = 0  # ... with a row of forced tokens from the host
        self.one_forced = 0  # ... of decode rows alone, one of them a forced token from the host
        self.prompted = 0  # ... from the step that computed a prompt's last chunk
        launch = runner.run_ahead

        def counted(plan, ids, pick):
            self.launched += 1
            self.constrained += any(r.seq.grammar is not None or r.seq.reasoning is not None and r.seq.reasoning.spec.banned_ids
                                    for r in plan.rows)
            self.forced += None in pick
            self.one_forced += None in pick and all(r.n_tokens == 1 for r in plan.rows)
            self.prompted += any(r.seq.status is Status.PREFILL for r in plan.rows)
            return launch(plan, ids, pick)

        runner.run_ahead = counted

    @property
    def steps(self) -> int:
        """Steps the overlapping engine ran (its own count, by launch)."""
        return sum(self.engines[True].steps.values())

    def launches(self, overlap: bool) -> dict[str, int]:
        """A copy of the engine's steps by launch (`Engine.steps`)."""
        return dict(self.engines[overlap].steps)

    def prompt(self, text):
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def run_all(self, overlap: bool, requests: list[GenerationRequest], cancel_after: dict[str, int] | None = None):
        engine, loop = self.engines[overlap], asyncio.get_running_loop()

        async def one(request):
            handle = engine.submit(request, loop)
            tokens, text, reasoning, final = [], "", "", None
            async for out in handle:
                tokens += [t.token_id for t in out.tokens]
                text += out.text
                reasoning += out.reasoning
                if cancel_after and len(tokens) >= cancel_after.get(request.request_id, 1 << 30):
                    handle.cancel()
                final = out
            return tokens, text, reasoning, final.finish_reason, final.completion_tokens, final.cached_tokens

        return await asyncio.gather(*(one(r) for r in requests))

    def sessions(self, overlap: bool) -> dict[str, tuple[list[int], int]]:
        """Each named session's committed tokens and the length of its KV."""
        store = self.engines[overlap].cache_manager.store
        return {e.session_id: (list(e.tokens), e.kv.length) for e in store.list(Principal("anonymous")) if not e.session_id.startswith("anon-")}

    def stop(self):
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="module")
def engines(smollm2):
    both = Engines(smollm2)
    yield both
    both.stop()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.mark.anyio
async def test_the_runner_overlaps_on_the_paged_path(engines):
    assert engines.engines[True].runner.paths["overlap"] == "on"
    assert engines.engines[False].runner.paths["overlap"] == "off"


@pytest.mark.anyio
async def test_each_step_is_counted_by_how_it_was_launched(engines, smollm2):
    """`Engine.steps` (kvserve_engine_steps_total{launch}) counts each step once: "ahead" where
    it was launched while the step before was postprocessed, else why it waited. One greedy
    row alone: its first step waits ("idle": nothing ran before it), the others go ahead. A
    row asking for logprobs has its tokens chosen on the host; a prompt longer than a step's
    token budget is prefilled in chunks; a schema's keys are forced after the token before
    them; a request arriving mid-decode waits to be admitted (or, admitted already, to be
    prefilled). Without the overlap every step waited because it is off."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    form = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "form", "schema": FORM}}, None))
    long_prompt = engines.prompt("Summarize: " + " ".join(f"item {i}," for i in range(300)))
    assert len(long_prompt) > EngineConfig(max_context=2).max_batch_tokens
    cases = {
        "greedy": ([GenerationRequest("g", engines.prompt(PROMPTS[0]), greedy(max_tokens=12), use_session=False)], {"idle", "ahead"}),
        "logprobs": ([GenerationRequest("lp", engines.prompt(PROMPTS[1]), greedy(max_tokens=12, logprobs=True), use_session=False)],
                     {"idle", "host"}),
        "chunked": ([GenerationRequest("long", long_prompt, greedy(max_tokens=4), use_session=False)], {"idle", "prefill", "ahead"}),
        "schema": ([GenerationRequest("form", engines.prompt("Fill in form 1 as JSON."), greedy(max_tokens=40), grammar=form,
                                      use_session=False)], {"idle", "forced", "ahead"}),
    }
    for name, (requests, expected) in cases.items():
        for overlap in (True, False):
            before = engines.launches(overlap)
            await engines.run_all(overlap, requests)
            delta = {k: n - before[k] for k, n in engines.launches(overlap).items() if n > before[k]}
            assert set(delta) == (expected if overlap else {"off"}), (name, overlap, delta)

    # an arrival mid-decode: the step after it waits for the host to admit or prefill it
    engine, loop = engines.engines[True], asyncio.get_running_loop()
    before = engines.launches(True)
    first = engine.submit(GenerationRequest("first", engines.prompt(PROMPTS[2]), greedy(max_tokens=30), use_session=False), loop)
    outputs = aiter(first)
    await anext(outputs)
    await anext(outputs)
    later = engine.submit(GenerationRequest("later", engines.prompt(PROMPTS[3]), greedy(max_tokens=4), use_session=False), loop)
    async for _ in outputs:
        pass
    async for _ in later:
        pass
    delta = {k: n - before[k] for k, n in engines.launches(True).items()}
    assert delta["admission"] + delta["prefill"] > 0 and delta["ahead"] > 0, delta
    assert delta["host"] == delta["forced"] == delta["fault"] == delta["off"] == 0, delta


@pytest.mark.anyio
async def test_a_stop_at_every_position_gives_the_same_tokens_and_sessions(engines):
    """Every request of one batch stops at its own position, by a stop string, max_tokens or a
    thinking budget (whose end marker is forced after the sampled token); each also leaves a
    session. Outputs and sessions equal the engine without overlap's, and the next turn of each
    session reuses the same tokens."""
    reference = (await engines.run_all(False, [GenerationRequest("ref", engines.prompt(PROMPTS[0]), greedy(max_tokens=max(POSITIONS) + 4))]))[0]
    ids = reference[0]
    assert len(ids) > max(POSITIONS), "the reference must run past every stop position"
    tok = engines.tokenizer
    start, end = tok.convert_tokens_to_ids(["<|im_start|>"])[0], tuple(tok("<|im_end|>\n<|im_start|>", add_special_tokens=False)["input_ids"])

    def requests(turn: int) -> list[GenerationRequest]:
        out = []
        for k in POSITIONS:
            prompt = engines.prompt(PROMPTS[0])
            stop = [tok.decode(ids[:k])]  # the text through the k-th token: complete exactly there
            out.append(GenerationRequest(f"stop{k}-{turn}", prompt, greedy(max_tokens=32, stop=stop), session_id=f"stop{k}"))
            out.append(GenerationRequest(f"len{k}-{turn}", engines.prompt(PROMPTS[k % len(PROMPTS)]), greedy(max_tokens=k), session_id=f"len{k}"))
            think = ReasoningSpec(start_ids=(start,), end_ids=end, inside=True, budget=k - 1)
            out.append(GenerationRequest(f"think{k}-{turn}", engines.prompt(PROMPTS[(k + 1) % len(PROMPTS)]), greedy(max_tokens=k + 6),
                                         session_id=f"think{k}", reasoning=think))
        return out

    launched = engines.launched
    got = {overlap: await engines.run_all(overlap, requests(0)) for overlap in (True, False)}
    assert got[True] == got[False]
    assert engines.launched > launched, "no step was launched ahead"
    assert {r[3] for r in got[True]} == {"stop", "length"}
    assert [r[4] for r in got[True][1::3]] == list(POSITIONS)  # max_tokens = k: k tokens, no more
    assert engines.sessions(True) == engines.sessions(False)
    # the next turn of every session: the same reuse, the same tokens
    again = {overlap: await engines.run_all(overlap, requests(1)) for overlap in (True, False)}
    assert again[True] == again[False]
    assert all(r[5] > 0 for r in again[True])


@pytest.mark.anyio
async def test_rows_that_draw_launch_ahead_and_draw_what_they_would_have(engines):
    """Rows that draw (seeded ones with top-k and top-p, one with a logit bias, and one unseeded:
    the only user of torch's global generator, seeded alike before each engine runs), each
    stopping at its own max_tokens or a stop string, leave sessions: their steps are launched
    ahead from tokens drawn on the device, and outputs and sessions equal the engine without
    overlap's."""

    def requests():
        out = [GenerationRequest(f"seeded{i}", engines.prompt(p), SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i, max_tokens=6 + 3 * i),
                                 session_id=f"seeded{i}") for i, p in enumerate(PROMPTS)]
        out.append(GenerationRequest("stops", engines.prompt(PROMPTS[0]), SamplingParams(temperature=0.7, seed=9, max_tokens=24, stop=[" the", "."],
                                                                                          logit_bias={2: -5.0, 28: 2.0}), session_id="stops"))
        return out + [GenerationRequest("unseeded", engines.prompt(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=16), session_id="unseeded")]

    launched = engines.launched
    got = {}
    for overlap in (True, False):
        torch.manual_seed(1234)
        got[overlap] = await engines.run_all(overlap, requests())
    assert got[True] == got[False]
    assert engines.launched > launched, "no step of rows that draw was launched ahead"
    assert engines.sessions(True) == engines.sessions(False)


def masked_greedy(model, prompt: list[int], grammar, n: int) -> list[int]:
    """The model's greedy tokens under the grammar's mask, each from a fresh forward of the
    whole sequence (transformers alone), until the grammar ends or n tokens."""
    matcher, ids = grammar.new_matcher(), list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
        matcher.apply_mask(logits)
        token = int(logits.argmax())
        if token in grammar.eos_token_ids or not matcher.accept(token):
            break
        ids.append(token)
        if matcher.is_terminated:
            break
    return ids[len(prompt):]


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "river": {"type": "string", "maxLength": 16},
                   "founded": {"type": "integer"}},
    "required": ["city", "river", "founded"],
    "additionalProperties": False,
}


@pytest.mark.anyio
async def test_rows_under_grammars_and_bans_launch_ahead_and_choose_what_they_would_have(engines, smollm2):
    """The first user's every row is under a JSON schema: such rows (greedy, with a logit
    bias, seeded ones that draw; each ending at its own max_tokens or its object's end) and a
    thinking row whose spec bans the token it would write have their masks added on the
    device from one copy that does not wait, so their steps are launched ahead too, with the
    next masks computed while the device runs them. Outputs, sessions and the JSON equal the
    engine without overlap's; the objects that end validate."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    city = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}, None))
    tok = engines.tokenizer
    start, end = tok.convert_tokens_to_ids(["<|im_start|>"])[0], tuple(tok("<|im_end|>\n<|im_start|>", add_special_tokens=False)["input_ids"])
    thinking = ReasoningSpec(start_ids=(start,), end_ids=end, inside=True, budget=6)
    prompt = engines.prompt("Describe a city by its river, as JSON.")
    free = (await engines.run_all(False, [GenerationRequest("free", prompt, greedy(max_tokens=4), reasoning=thinking, use_session=False)]))[0][0]
    banned = ReasoningSpec(start_ids=(start,), end_ids=end, inside=True, budget=6, banned_ids=frozenset(free[1:3]))

    def requests():
        out = [GenerationRequest(f"json{k}", engines.prompt(f"Describe city number {k} as JSON."), greedy(max_tokens=k), grammar=city,
                                 session_id=f"json{k}") for k in (3, 9, 17, 60)]
        out.append(GenerationRequest("bias", prompt, greedy(max_tokens=60, logit_bias={28: 4.0, 33: -2.0}), grammar=city,
                                   session_id="bias"))
        out += [GenerationRequest(f"drawn{i}", engines.prompt(p), SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=60),
                                  grammar=city, session_id=f"drawn{i}") for i, p in enumerate(PROMPTS[:2])]
        return out + [GenerationRequest("banned", prompt, greedy(max_tokens=12), reasoning=banned, session_id="banned")]

    launched, constrained = engines.launched, engines.constrained
    got = {overlap: await engines.run_all(overlap, requests()) for overlap in (True, False)}
    assert got[True] == got[False]
    assert engines.constrained > constrained and engines.launched > launched, "no step of constrained rows was launched ahead"
    assert engines.sessions(True) == engines.sessions(False)
    ended = [text for text, _, finish in ((r[1], r[2], r[3]) for r in got[True][:-1]) if finish == "stop"]
    assert len(ended) >= 2
    for text in ended:
        jsonschema.validate(json.loads(text), CITY)
    assert [r[4] for r in got[True][:3]] == [3, 9, 17]  # max_tokens = k: k tokens, no more
    json60 = requests()[3]  # and transformers' greedy tokens under the same masks, step by step
    assert_equivalent(smollm2.model, json60.prompt_ids, got[True][3][0], masked_greedy(smollm2.model, json60.prompt_ids, city, 60), city)
    assert got[True][-1][0][1:3] != free[1:3]  # the ban changed what the thinking row wrote


FORM = {  # short keys, each forced whole after the value before it: a step of more than decode rows every few tokens
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 6},
                   "n": {"type": "integer"}, "unit": {"enum": ["mm", "cm", "m"]}, "note": {"type": "string", "maxLength": 8}},
    "required": ["id", "ok", "tag", "n", "unit", "note"],
    "additionalProperties": False,
}


@pytest.mark.anyio
async def test_rows_with_forced_tokens_launch_ahead_beside_the_others(engines, smollm2):
    """A grammar forces a schema's keys after the value before them, and a thinking budget its
    end marker: those tokens are known on the host only once the token before them is. The
    step launched ahead that computed that token for the row drops it, and the next one is
    launched ahead too, with the row's forced tokens from the host beside the other rows'
    tokens from the device (the step waiting would have made), as is the step after a
    prompt's last chunk. Outputs, sessions and the JSON equal the engine without overlap's; a
    greedy row equals transformers' argmax under the same masks."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    form = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "form", "schema": FORM}}, None))
    tok = engines.tokenizer
    start, end = tok.convert_tokens_to_ids(["<|im_start|>"])[0], tuple(tok("<|im_end|>\n<|im_start|>", add_special_tokens=False)["input_ids"])

    def requests():
        out = [GenerationRequest(f"form{k}", engines.prompt(f"Fill in form {k} as JSON."), greedy(max_tokens=80), grammar=form,
                                 session_id=f"form{k}") for k in range(3)]
        out += [GenerationRequest(f"drawn{i}", engines.prompt(p), SamplingParams(temperature=0.9, seed=i, max_tokens=80), grammar=form,
                                  session_id=f"drawn{i}") for i, p in enumerate(PROMPTS[:2])]
        think = ReasoningSpec(start_ids=(start,), end_ids=end, inside=True, budget=5)
        out.append(GenerationRequest("think", engines.prompt(PROMPTS[2]), greedy(max_tokens=20), reasoning=think, session_id="think"))
        return out + [GenerationRequest("free", engines.prompt(PROMPTS[3]), greedy(max_tokens=40), session_id="free")]

    before = engines.forced, engines.prompted, engines.one_forced
    got = {overlap: await engines.run_all(overlap, requests()) for overlap in (True, False)}
    print("launched ahead with forced tokens:", engines.forced - before[0], "of them one forced token beside decode rows:",
          engines.one_forced - before[2])
    assert got[True] == got[False]
    assert engines.forced > before[0], "no step with a row of forced tokens was launched ahead"
    assert engines.one_forced > before[2], "no row kept the token computed ahead before its forced one"
    assert engines.prompted > before[1], "no step was launched ahead from a prompt's last chunk"
    assert engines.sessions(True) == engines.sessions(False)
    ended = [r[1] for r in got[True][:5] if r[3] == "stop"]
    assert len(ended) >= 3
    for text in ended:
        jsonschema.validate(json.loads(text), FORM)
    form0 = requests()[0]
    assert_equivalent(smollm2.model, form0.prompt_ids, got[True][0][0], masked_greedy(smollm2.model, form0.prompt_ids, form, 80), form)


@pytest.mark.anyio
async def test_steps_wait_for_each_other_while_rows_have_tokens_forced_often(smollm2):
    """A forced token costs its row a step under the overlap (it is known a step later), so
    with the default `overlap_forced_max` rows of a schema of short keys, forced every few
    tokens, run mostly in steps that wait for each other, and free rows beside it make the
    engine launch ahead again; outputs are the same either way."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, eos_token_ids=[smollm2.tokenizer.eos_token_id])
    form = compiler.compile(spec_from_request({"type": "json_schema", "json_schema": {"name": "form", "schema": FORM}}, None))
    both = Engines(smollm2, forced_max=EngineConfig(max_context=2).overlap_forced_max)  # (the default)
    try:
        shares = []
        for grammar in (form, None):
            requests = [GenerationRequest(f"r{k}", both.prompt(f"Fill in form {k} as JSON."), greedy(max_tokens=60), grammar=grammar,
                                          use_session=False) for k in range(4)]
            steps, launched = both.steps, both.launched
            got = {overlap: await both.run_all(overlap, requests) for overlap in (True, False)}
            assert got[True] == got[False]
            shares.append((both.launched - launched) / (both.steps - steps))
        print("steps launched ahead: forced often", shares[0], "free", shares[1])
        assert shares[0] < 0.5 < 0.8 < shares[1], shares
    finally:
        both.stop()


def test_a_step_launched_ahead_gives_each_row_its_own_token_in_any_order(smollm2):
    """`ModelRunner.run_ahead` takes row i's token at `pick[i]` of the device's ids, in
    whatever order (the scheduler's order puts a prompt that ended after a decode row that
    started later), and a row's tokens from the host beside them (one token: the decode
    buffer; several: the step of more than decode rows). Its logits are those of the same
    step run with every token on the host."""
    from cache_manager import kv
    from server.engine.model_runner import ModelRunner
    from server.engine.scheduler import Plan, ScheduledRow
    from server.engine.sequence import Sequence

    pool = kv.Pool(smollm2.model.config, kv.bytes_for(smollm2.model.config, 1024, smollm2.dtype), smollm2.device, smollm2.dtype)
    runner = ModelRunner(smollm2.model, pool, paged=True, cuda_graphs=False, packed=None, overlap=True)
    prompts = [smollm2.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:3]]
    given = [11, 22, 33, 44]  # the tokens each row computes next (row 2: two of them)

    def rows(host: list[bool]) -> list[Sequence]:
        seqs = []
        for i, prompt in enumerate(prompts[: len(host)]):
            seq = Sequence(GenerationRequest(f"r{i}", prompt, greedy(max_tokens=8)), smollm2.tokenizer, smollm2.device)
            seq.cache = pool.allocate(len(prompt) + 4)
            runner.run(Plan([ScheduledRow(seq, len(prompt))]))
            if host[i]:
                seq.all_ids += given[i:i + 1] if i < 2 else given[2:]
            seqs.append(seq)
        return seqs

    def plan(seqs: list[Sequence], host: list[bool]) -> Plan:
        out = Plan([ScheduledRow(s, s.num_pending if h else 1) for s, h in zip(seqs, host)])
        for row in out.rows:
            row.completes = True
        return out

    swapped = torch.tensor([given[1], given[0]], device=smollm2.device)  # row 0's token at 1, row 1's at 0
    device = torch.tensor([given[1], -1, given[0]], device=smollm2.device)  # ... at 2 and 0
    for host, ids, pick in (([False, False], swapped, [1, 0]), ([False, False], device, [2, 0]), ([True, False], device, [None, 0]),
                            ([False, False, True], device, [2, 0, None])):
        wanted = [True] * len(host)
        want = runner.run(plan(rows(wanted), wanted)).logits
        got = runner.run_ahead(plan(rows(host), host), ids, pick).logits
        assert torch.equal(got, want), (host, pick)


@pytest.mark.anyio
async def test_cancels_arrivals_and_sampled_rows_mid_stream(engines):
    """A row cancelled while a step is ahead, requests that arrive mid-stream (they take the
    next step: the overlap pauses for their prefill, and they finish while the others still
    run) and a seeded sampled row leave every output as the engine without overlap gives it."""

    async def scenario(overlap: bool):
        first = [GenerationRequest(f"a{i}", engines.prompt(p), greedy(max_tokens=48)) for i, p in enumerate(PROMPTS)]
        running = asyncio.ensure_future(engines.run_all(overlap, first, cancel_after={"a1": 5}))
        while engines.engines[overlap].idle:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        later = [GenerationRequest("b0", engines.prompt("Tell me about owls."), greedy(max_tokens=4)),
                 GenerationRequest("b1", engines.prompt("Tell me about bread."), SamplingParams(temperature=0.9, seed=3, max_tokens=4))]
        arrived = await engines.run_all(overlap, later)
        assert not running.done(), "the requests that arrived waited for the others to end"
        return await running, arrived

    with_overlap, without = await scenario(True), await scenario(False)
    cancelled = 1

    def outputs(results, skip=None):  # (anonymous reuse follows each engine's earlier tests: not compared)
        return [r[:5] for i, r in enumerate(results) if i != skip]

    assert outputs(with_overlap[0], cancelled) == outputs(without[0], cancelled)
    assert with_overlap[0][cancelled][3] == "abort" and without[0][cancelled][3] == "abort"
    assert outputs(with_overlap[1]) == outputs(without[1])


def test_a_cache_that_fills_before_max_tokens_ends_where_it_would_have(smollm2):
    """Engines whose context (64 tokens) ends before max_tokens: each row stops with "length"
    when its cache is full, the step launched ahead into its last slot not counted, so it
    emits as many tokens, and its session holds as many, as without overlap."""
    small = Engines(smollm2, max_context=64)
    try:
        async def both():
            requests = [GenerationRequest(f"full{i}", small.prompt(p), greedy(max_tokens=200), session_id=f"full{i}") for i, p in enumerate(PROMPTS[:3])]
            return {overlap: await small.run_all(overlap, requests) for overlap in (True, False)}

        got = asyncio.run(both())
        assert got[True] == got[False]
        assert all(r[3] == "length" and r[4] < 200 for r in got[True])
        assert small.launched > 0
        assert small.sessions(True) == small.sessions(False)
        assert all(length == 64 for _, length in small.sessions(True).values())
    finally:
        small.stop()


RARE = 40000  # a token id no request here writes unless biased to it


class Overflows:
    """A model that overflows on one input token: a hook on its embedding turns the token's
    vector NaN, so a row's logits are NaN at the step whose pending token it is. Installed
    before the engines are made, so that a captured graph or a compiled forward holds it."""

    def __init__(self, model, token: int) -> None:
        self.hook = model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out.masked_fill(args[0][..., None] == token, float("nan")))

    def remove(self) -> None:
        self.hook.remove()


@pytest.mark.anyio
async def test_a_step_retried_in_parts_makes_the_next_one_wait(engines):
    """A forward pass that raises on one row's token (a hook on the embedding: a prompt ending
    in RARE) is retried in halves (`Engine._execute`) until that row fails alone; the other row
    ran in a part, and the step after waits for the whole step's postprocess ("fault"), then
    the overlap resumes. The row that ran on gives the tokens it gives alone."""

    def refuse(module, args):
        if (args[0] == RARE).any():
            raise RuntimeError("a kernel failed on this row's token")

    engine, loop = engines.engines[True], asyncio.get_running_loop()
    alone = (await engines.run_all(False, [GenerationRequest("alone", engines.prompt(PROMPTS[0]), greedy(max_tokens=24), use_session=False)]))[0]
    hook = engine.model.get_input_embeddings().register_forward_pre_hook(refuse)
    try:
        before = engines.launches(True)
        ok = engine.submit(GenerationRequest("ok", engines.prompt(PROMPTS[0]), greedy(max_tokens=24), use_session=False), loop)
        outputs, tokens = aiter(ok), []
        tokens += [t.token_id for t in (await anext(outputs)).tokens]
        bad = engine.submit(GenerationRequest("bad", engines.prompt(PROMPTS[1]) + [RARE], greedy(max_tokens=4), use_session=False), loop)
        async for out in outputs:
            tokens += [t.token_id for t in out.tokens]
        async for final in bad:
            pass
    finally:
        hook.remove()
    delta = {k: n - before[k] for k, n in engines.launches(True).items()}
    assert final.finish_reason == "error" and engine.dead is None
    assert tokens == alone[0]
    assert delta["fault"] >= 1 and delta["ahead"] > 0, delta


@pytest.mark.parametrize("chosen_on", ["device", "host"])
def test_a_row_that_draws_from_nan_logits_fails_alone(smollm2, chosen_on):
    """A drawing row whose logits turn NaN (biased to write RARE, on which the model overflows)
    draws -1; on the device, the step launched ahead from it runs on and drops it. The row
    fails alone with an error after the one token it wrote. The other rows (greedy, and draws
    from their own seeds, each drawn once) give what they give without it, overlap on and off,
    and nothing stops the engine. "host": a row asks for logprobs, so the step's tokens are
    chosen on the host, all rows in one draw."""
    overflows = Overflows(smollm2.model, RARE)
    both = Engines(smollm2)
    try:
        def requests(poisoned: bool) -> list[GenerationRequest]:
            out = [GenerationRequest(f"s{i}", both.prompt(p), SamplingParams(temperature=0.9, seed=i, max_tokens=10)) for i, p in enumerate(PROMPTS)]
            out.append(GenerationRequest("g", both.prompt(PROMPTS[0]), greedy(max_tokens=10, logprobs=chosen_on == "host")))
            if poisoned:
                out.append(GenerationRequest("nan", both.prompt(PROMPTS[1]), SamplingParams(temperature=1.0, seed=9, max_tokens=10, logit_bias={RARE: 100.0})))
            return out

        async def run():
            return [await both.run_all(overlap, requests(poisoned)) for overlap, poisoned in ((True, True), (False, True), (False, False))]

        *poisoned, clean = asyncio.run(run())
        for overlap, got in zip((True, False), poisoned):
            *others, bad = got
            assert [r[:5] for r in others] == [r[:5] for r in clean]  # (anonymous reuse follows the runs before: not compared)
            assert all(RARE not in r[0] for r in others)
            assert bad[0] == [RARE] and bad[3] == "error"
            assert both.engines[overlap].dead is None
        assert (both.launched > 0) == (chosen_on == "device"), "a step was launched ahead where it could not be, or none where it could"
    finally:
        both.stop()
        overflows.remove()


def test_a_device_fault_at_a_steps_copy_ends_the_engine_loudly(smollm2):
    """On CUDA an asynchronous device error (an illegal address in a kernel of the step launched
    ahead) surfaces where the host waits for a step's tokens, outside any row's fault handling.
    The engine dies as a broken model makes it die (`dead` set, every request ends with
    engine_dead, /health then 503), instead of its thread ending quietly while requests wait."""
    both = Engines(smollm2)
    engine = both.engines[True]

    def to_host(ids):
        def wait():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return wait

    engine.runner.to_host = to_host
    try:
        requests = [GenerationRequest(f"r{i}", both.prompt(p), greedy(max_tokens=16)) for i, p in enumerate(PROMPTS)]
        got = asyncio.run(asyncio.wait_for(both.run_all(True, requests), 60))
        assert [r[3] for r in got] == ["error"] * len(PROMPTS)
        assert engine.dead is not None and "illegal memory access" in engine.dead
    finally:
        both.stop()
