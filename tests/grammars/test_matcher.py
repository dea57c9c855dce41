"""grammars/matcher.py driven token by token with the real SmolLM2 tokenizer (no forward pass)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from grammars import GrammarCompiler, GrammarSpec, tool_call_spec
from grammars.matcher import additive_masks, start_draft_masks
from tests.device import DEVICE

from .conftest import EOS, VOCAB_SIZE

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def matcher(compiler, kind, payload=None, **kw):
    if kind == "json_schema":
        payload = json.dumps(payload)
    return compiler.compile(GrammarSpec(kind, payload, **kw)).new_matcher()


def test_valid_json_drives_to_termination(compiler, walk):
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":"Bob","age":42}')
    assert m.is_terminated and m.is_accepting and m.error is None
    assert m.stop_reason == "NoExtension"
    only = m.allowed_tokens()
    assert only.sum() == 1 and only[EOS]  # a finished grammar allows EOS alone


def test_disallowed_tokens_get_minus_inf_and_allowed_are_untouched(compiler, walk, tokenizer):
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":"')
    allowed = m.allowed_tokens()
    logits = torch.randn(VOCAB_SIZE, device=DEVICE)
    before = logits.clone()
    m.start_mask()
    m.apply_mask(logits)
    assert torch.equal(torch.isfinite(logits).cpu(), allowed)  # the mask is the matcher's, on the CPU
    assert torch.equal(logits[allowed], before[allowed])
    assert allowed[tokenizer.encode("Bob")[0]]
    assert not allowed[tokenizer.encode("\n")[0]]  # a raw newline cannot be in a JSON string
    assert m.last_mask_s > 0


def test_eos_is_masked_until_the_grammar_accepts(compiler, walk):
    m = matcher(compiler, "regex", "[0-9]+")
    assert not m.allowed_tokens()[EOS] and not m.is_accepting
    logits = torch.zeros(VOCAB_SIZE, device=DEVICE)
    m.apply_mask(logits)
    assert logits[EOS] == float("-inf")
    walk(m, "12")
    assert m.is_accepting and not m.is_terminated  # more digits or EOS
    allowed = m.allowed_tokens()
    assert allowed[EOS] and allowed.sum() > 1
    assert m.accept(EOS) and m.is_terminated and m.stop_reason == "EndOfSentence"


def test_json_is_compact_unless_flexible(compiler, walk):
    m = matcher(compiler, "json_object")
    walk(m, '{"a":[1,{"b":null}]')
    assert not m.allowed_tokens()[compiler.ll_tokenizer.tokenize_str(" ")[0]]
    flexible = matcher(compiler, "json_object", whitespace_flexible=True)
    walk(flexible, '{"a": [1, {"b": null}]}')
    assert flexible.is_terminated


def test_fast_forward_tokens_spell_the_required_keys(compiler, tokenizer, walk):
    m = matcher(compiler, "json_schema", PERSON)
    ff = m.fast_forward_tokens()
    assert ff and '{"name'.startswith(tokenizer.decode(ff)) and "name" in tokenizer.decode(ff)
    assert m.num_accepted == 0  # computing them consumes nothing
    assert m.accept_tokens(ff)
    walk(m, '":"Al","age')
    key_heavy = {
        "type": "object",
        "properties": {"temperature_celsius": {"type": "integer"},
                       "relative_humidity_percent": {"type": "integer"}},
        "required": ["temperature_celsius", "relative_humidity_percent"],
        "additionalProperties": False,
    }
    m = matcher(compiler, "json_schema", key_heavy)
    m.accept_tokens(m.fast_forward_tokens())
    walk(m, '":21')
    ff = m.fast_forward_tokens()
    assert not ff  # "21" may still grow: nothing is forced inside a number
    walk(m, ",")
    ff = m.fast_forward_tokens()
    assert "relative_humidity_percent" in tokenizer.decode(ff)


def test_rollback_restores_the_earlier_state(compiler, walk):
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":"')
    mask = m.allowed_tokens().clone()
    n = len(walk(m, 'Bob","age":7}'))
    assert m.is_terminated
    m.rollback(n)
    assert torch.equal(m.allowed_tokens(), mask) and not m.is_terminated
    walk(m, 'Eve","age":8}')
    assert m.is_terminated
    with pytest.raises(ValueError):
        m.rollback(m.num_accepted + 1)


def test_eos_after_completion_rolls_back_alone(compiler, walk):
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":"A","age":1}')
    assert m.accept(EOS) and m.is_terminated
    m.rollback(1)  # the EOS only: the object is still complete
    assert m.is_terminated
    m.rollback(1)  # now the closing brace
    assert not m.is_terminated and not m.allowed_tokens()[EOS]


def test_refused_token_is_an_error_with_one_line(compiler, walk, tokenizer):
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":')
    assert not m.accept(tokenizer.encode("7")[0])
    assert m.error and "\n" not in m.error and "<state>" not in m.error
    assert not m.is_terminated and m.fast_forward_tokens() == []
    only = m.allowed_tokens()
    assert only.sum() == 1 and only[EOS]  # why the engine must check accept()'s result


def test_each_request_gets_its_own_copy(compiler, walk):
    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    a, b = compiled.new_matcher(), compiled.new_matcher()
    walk(a, '{"name":"x","age":2}')
    assert a.is_terminated and b.num_accepted == 0 and not b.is_accepting
    walk(b, '{"name":"y","age":3}')
    assert b.is_terminated


def test_choice_lark_gbnf_and_tool_calls(compiler, walk):
    m = matcher(compiler, "choice", ("yes", 'é "q"'))
    walk(m, 'é "q"')
    assert m.is_terminated
    m = matcher(compiler, "lark", 'start: "hi " NAME\nNAME: /[a-z]+/')
    walk(m, "hi bob")
    assert m.is_accepting
    m = matcher(compiler, "gbnf", 'root ::= "a" [0-9] [0-9]')
    walk(m, "a42")
    assert m.is_terminated
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}}}}
    clock = {"type": "function", "function": {"name": "now"}}
    compiled = compiler.compile(tool_call_spec([weather, clock], "required"))
    m = compiled.new_matcher()
    walk(m, '<tool_call>{"name":"get_weather","arguments":{"where":{"city":"Oslo"}}}</tool_call>')
    assert m.is_accepting  # more calls may follow (tests/grammars/test_tools.py)
    m = compiled.new_matcher()
    walk(m, '<tool_call>{"name":"now","arguments":')
    with pytest.raises(AssertionError):
        walk(m, '{"where"')  # `now` takes no arguments


def test_logits_wider_than_the_tokenizer(tokenizer, walk):
    wide = GrammarCompiler(tokenizer, VOCAB_SIZE + 64)
    m = wide.compile(GrammarSpec("regex", "[a-z]+")).new_matcher()
    logits = torch.zeros(VOCAB_SIZE + 64, device=DEVICE)
    m.apply_mask(logits)
    assert torch.isinf(logits[VOCAB_SIZE:]).all() and torch.isfinite(logits).any()
    with pytest.raises(ValueError):
        m.apply_mask(torch.zeros(VOCAB_SIZE, device=DEVICE))


def test_engine_loop_with_mask_in_the_worker(compiler, tokenizer):
    m = matcher(compiler, "regex", "[0-9]{12}")
    out = []
    while True:
        m.start_mask()  # the worker computes while the "forward pass" runs
        assert not m.is_terminated and m.error is None  # queries wait for the worker
        logits = torch.zeros(VOCAB_SIZE, device=DEVICE)
        m.apply_mask(logits)
        tok = int(torch.argmax(logits))
        assert m.accept(torch.tensor(tok, device=DEVICE))
        out.append(tok)
        if m.is_terminated:
            break
    text = tokenizer.decode(out)
    assert len(text) == 12 and text.isdigit() and m.stop_reason == "NoExtension"


def test_draft_prefix_checks_and_rolls_back_and_draft_masks_follow_the_draft(compiler, walk, tokenizer):
    """Speculative decoding: a draft is cut to what the grammar accepts, and before a point
    where the grammar would complete or force tokens; the state is unchanged after the check.
    The draft's masks equal the masks of accepting its tokens one by one."""
    m = matcher(compiler, "json_schema", PERSON)
    walk(m, '{"name":"')
    ids = tokenizer.encode("Bob Smith\n")  # the raw newline cannot be in a JSON string
    n, ends = m.draft_prefix(ids)
    assert (n, ends) == (len(ids) - 1, False) and m.num_accepted == 3
    quote = tokenizer.encode('",')  # closing the string forces the next key
    n, ends = m.draft_prefix(ids[:-1] + quote)
    assert n == len(ids) and ends  # cut after the token after which tokens are forced
    assert m.draft_prefix(ids[:-1] + quote, stop_at_forced=False)[0] >= n
    start_draft_masks([(m, ids[:-1])])
    masks = m.draft_masks()
    for i, token in enumerate(ids[:-1]):
        assert torch.equal(masks[i] == 0, m.allowed_tokens()), i
        assert m.accept(token)
    assert torch.equal(masks[-1] == 0, m.allowed_tokens())


def test_additive_masks_unpack_llguidance_words_on_the_logits_device():
    """Mask words [R, n_words] (bit i of a row allows token i, as llguidance writes them)
    become 0 / -inf a token on the device, cut to the vocabulary (here not a multiple of 32,
    and words wider than it): numpy's own unpacking of the same bytes says which."""
    words = np.random.default_rng(0).integers(-(2**31), 2**31, size=(3, 10), dtype=np.int64).astype(np.int32)
    vocab = 9 * 32 - 5
    masks = additive_masks(words, vocab, DEVICE)
    assert masks.device.type == torch.device(DEVICE).type and masks.dtype == torch.float32 and masks.shape == (3, vocab)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    assert torch.equal(masks.cpu(), torch.from_numpy(np.where(bits == 1, 0.0, -np.inf).astype(np.float32)))


def test_a_steps_constraints_mask_their_rows_alone(compiler, walk, tokenizer):
    """`sampler.apply_constraints` over a step of three rows: a grammar row, a row with no
    constraint, a thinking row whose spec bans tokens. Each constrained row gets exactly its
    own mask added (the grammar's allowed tokens and the row's other logits untouched, -inf
    elsewhere), and the free row keeps its logits bit for bit."""
    from server.engine import sampler
    from server.engine.reasoning import ReasoningSpec
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest, Sequence

    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    think = ReasoningSpec(tuple(tokenizer.encode("<think>")), tuple(tokenizer.encode("</think>")), inside=True, banned_ids=frozenset({5, 77}))
    seqs = [Sequence(GenerationRequest("g", [1], params, grammar=grammar), tokenizer, DEVICE),
            Sequence(GenerationRequest("f", [1], params), tokenizer, DEVICE),
            Sequence(GenerationRequest("t", [1], params, reasoning=think), tokenizer, DEVICE)]
    walk(seqs[0].matcher, '{"name":"')
    allowed = seqs[0].matcher.allowed_tokens().to(DEVICE)
    logits = torch.randn(3, VOCAB_SIZE, device=DEVICE)
    before = logits.clone()
    sampler.apply_constraints(seqs, logits)
    assert torch.equal(torch.isfinite(logits[0]), allowed) and torch.equal(logits[0][allowed], before[0][allowed])
    assert torch.equal(logits[1], before[1])
    banned = torch.zeros(VOCAB_SIZE, dtype=torch.bool, device=DEVICE)
    banned[[5, 77]] = True
    assert torch.equal(torch.isinf(logits[2]), banned) and torch.equal(logits[2][~banned], before[2][~banned])


def test_bench_masks_ways_give_the_same_logits():
    """bench.masks times the engine's way (words unpacked on the device) against the way
    before (float masks built on the host): the two add the same masks, bit for bit."""
    from bench import masks as bench_masks

    words = np.random.default_rng(1).integers(-(2**31), 2**31, size=(3, 40), dtype=np.int64).astype(np.int32)
    before = torch.randn(3, 1250, device=DEVICE)
    now = before.clone()
    bench_masks.floats(words, before)
    bench_masks.now(words, now)
    assert torch.equal(before, now) and torch.isinf(now).any() and torch.isfinite(now).any()
