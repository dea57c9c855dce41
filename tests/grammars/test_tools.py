"""grammars/tools.py: tool formats, markers, and the call grammars as the matcher enforces them."""

from __future__ import annotations

import copy

import pytest

from grammars import (
    KVSERVE_FORMAT,
    GrammarCompiler,
    auto_tool_spec,
    output_format,
    tool_call_spec,
    tool_format,
)
from tests.grammars.conftest import VOCAB_SIZE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
PARIS = '{"name":"get_weather","arguments":{"city":"Paris"}}'
NOW = '{"name":"now","arguments":{}}'


def with_markers(tokenizer, *markers: str):
    """A copy of the SmolLM2 tokenizer carrying `markers` as added special tokens."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    return tok


@pytest.fixture(scope="module")
def hermes(tokenizer):
    tok = with_markers(tokenizer, "<tool_call>", "</tool_call>")
    return tok, GrammarCompiler(tok, VOCAB_SIZE + 2, eos_token_ids=[2])


def test_formats_from_marker_tokens(tokenizer):
    assert tool_format(tokenizer) is None  # SmolLM2: kvserve's own wrappers
    assert output_format(None) is KVSERVE_FORMAT
    hermes = tool_format(with_markers(tokenizer, "<tool_call>", "</tool_call>"))
    assert hermes.name == "hermes" and hermes.marker_ids == {VOCAB_SIZE, VOCAB_SIZE + 1}
    llama = tool_format(with_markers(tokenizer, "<|python_tag|>"))
    assert llama.name == "llama3" and llama.arguments_key == "parameters"
    assert tool_format(with_markers(tokenizer, "[TOOL_CALLS]")).name == "mistral"
    assert tool_format(with_markers(tokenizer, "<tool_call>")) is None  # an open marker alone is not Hermes'
    text = hermes.render([("now", {}), ("get_weather", {"city": "Oslo"})], {VOCAB_SIZE: "<tool_call>", VOCAB_SIZE + 1: "</tool_call>"})
    assert text == '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_required_allows_several_calls_unless_parallel_is_off(compiler, walk):
    several = compiler.compile(tool_call_spec([WEATHER, CLOCK], "required")).new_matcher()
    walk(several, f"<tool_call>{PARIS}</tool_call>\n<tool_call>{NOW}</tool_call>\n<tool_call>{PARIS}</tool_call>")
    assert several.is_accepting
    one = compiler.compile(tool_call_spec([WEATHER, CLOCK], "required", parallel=False)).new_matcher()
    walk(one, f"<tool_call>{NOW}</tool_call>")
    assert one.is_terminated
    named = compiler.compile(tool_call_spec([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}})).new_matcher()
    walk(named, f"<tool_call>{NOW}</tool_call>")
    assert named.is_terminated  # a named function is always one call
    bad = compiler.compile(tool_call_spec([WEATHER, CLOCK], "required")).new_matcher()
    with pytest.raises(AssertionError):
        walk(bad, f'<tool_call>{PARIS}</tool_call>\n<tool_call>{{"name":"get_weather","arguments":{{"town"')


def test_auto_without_marker_first_character_decides(compiler, walk):
    spec = auto_tool_spec([WEATHER, CLOCK])
    calls = compiler.compile(spec).new_matcher()
    walk(calls, f"<tool_call>{PARIS}</tool_call>\n<tool_call>{NOW}</tool_call>")
    assert calls.is_accepting
    text = compiler.compile(spec).new_matcher()
    walk(text, "Sure, a <b> tag")
    assert text.is_accepting
    html = compiler.compile(spec).new_matcher()
    with pytest.raises(AssertionError):
        walk(html, "<b>bold</b>")  # kvserve's trigger: text may not start with `<`
    single = compiler.compile(auto_tool_spec([WEATHER], parallel=False)).new_matcher()
    walk(single, f"<tool_call>{PARIS}</tool_call>")
    assert single.is_terminated


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_auto_with_marker_text_may_start_with_anything(hermes):
    tok, compiler = hermes
    open_id, close_id = VOCAB_SIZE, VOCAB_SIZE + 1
    m = compiler.compile(auto_tool_spec([WEATHER, CLOCK], fmt=tool_format(tok))).new_matcher()
    assert m.allowed_tokens()[open_id] and m.allowed_tokens()[44] and not m.allowed_tokens()[close_id]
    assert m.accept_tokens(ids_of(tok, "<html>Checking.\n"))
    assert m.is_accepting  # free text alone is a complete answer
    assert m.accept(open_id)
    forced = m.fast_forward_tokens()  # the marker started a call: its start is forced
    assert tok.decode(forced) == '\n{"name":"'
    assert m.accept_tokens(forced)
    rest = ids_of(tok, PARIS.removeprefix('{"name":"')) + ids_of(tok, "\n")
    assert m.accept_tokens(rest), m.error
    allowed = m.allowed_tokens()
    assert allowed[close_id] and allowed.sum() == 1  # nothing but the closing marker
    assert m.accept(close_id) and m.is_accepting
    assert m.accept_tokens(ids_of(tok, "\n")) and m.accept(open_id)  # a second call may follow
    assert not m.allowed_tokens()[44]  # after the marker only the call's JSON (from "\n{")


def test_forced_with_marker_starts_with_the_marker(hermes, tokenizer):
    tok, compiler = hermes
    m = compiler.compile(tool_call_spec([WEATHER], "required", fmt=tool_format(tok))).new_matcher()
    forced = m.fast_forward_tokens()
    assert forced[0] == VOCAB_SIZE and tok.decode(forced[1:]).startswith('\n{"name":"get_weather","arguments":{"city')
    llama_tok = with_markers(tokenizer, "<|python_tag|>")
    llama = GrammarCompiler(llama_tok, VOCAB_SIZE + 1, eos_token_ids=[2])
    m = llama.compile(tool_call_spec([WEATHER, CLOCK], "required", fmt=tool_format(llama_tok))).new_matcher()
    assert m.fast_forward_tokens()[0] == VOCAB_SIZE
    assert m.accept_tokens([VOCAB_SIZE, *ids_of(llama_tok, '{"name":"now","parameters":{}}; {"name":"now","parameters":{}}')])
    assert m.is_accepting
