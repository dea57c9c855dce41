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


# ---------------------------------------------------------------- formats by family


def test_family_formats_from_markers_and_template(tokenizer):
    from tests.server.test_tool_formats import FAMILIES, family_tokenizer

    assert {name: tool_format(family_tokenizer(tokenizer, name)).name for name in FAMILIES} == {
        "qwen3_coder": "qwen3_coder", "glm45": "glm45", "deepseek": "deepseek", "harmony": "harmony"}
    qwen3 = with_markers(tokenizer, "<tool_call>", "</tool_call>")
    qwen3.chat_template = "{{ '<tool_call>\\n<function=' + name + '>' }}"
    assert tool_format(qwen3).name == "qwen3_coder"  # Hermes' markers, a template that writes `<function=`
    harmony = tool_format(family_tokenizer(tokenizer, "harmony"))
    assert not harmony.parallel and len(harmony.marker_ids) == 7  # the end markers are seen too


FAMILY_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 14},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
FAMILY_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def family_compilers(tokenizer):
    from tests.server.test_tool_formats import FAMILIES, family_tokenizer

    toks = {name: family_tokenizer(tokenizer, name) for name in FAMILIES}
    return {name: (tok, GrammarCompiler(tok, len(tok), eos_token_ids=[2])) for name, tok in toks.items()}


def family_text(tok, calls, *, raw: str | None = None) -> list[int]:
    """Token ids of `calls` written by the family's format (or of `raw`, markers as text)."""
    fmt = tool_format(tok)
    text = raw if raw is not None else fmt.render(calls, {i: tok.convert_ids_to_tokens(i) for i in fmt.marker_ids})
    return ids_of(tok, text)


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45", "deepseek", "harmony"])
def test_family_grammars_accept_a_call_and_refuse_a_wrong_one(family_compilers, family):
    tok, compiler = family_compilers[family]
    fmt = tool_format(tok)
    good = [("get_weather", {"city": "Pa\n<b>ris", "days": 3, "unit": "c"})]
    if fmt.parallel:
        good.append(("get_time", {}))
    wrong = {
        "missing": ("get_weather", {"city": "Oslo"}),  # `unit` is required
        "enum": ("get_weather", {"city": "Oslo", "unit": "k"}),
        "type": ("get_weather", {"city": "Oslo", "days": "three", "unit": "c"}),
        "bound": ("get_weather", {"city": "Oslo", "days": 15, "unit": "c"}),
        "name": ("get_wether", {}),
    }
    forced = compiler.compile(tool_call_spec([FAMILY_WEATHER, FAMILY_TIME], "required", fmt=fmt))
    m = forced.new_matcher()
    assert m.accept_tokens(family_text(tok, good)), m.error
    assert m.is_accepting
    for why, call in wrong.items():
        m = forced.new_matcher()
        assert not m.accept_tokens(family_text(tok, [call])), why
    auto = compiler.compile(auto_tool_spec([FAMILY_WEATHER, FAMILY_TIME], fmt=fmt))
    text = "<|channel|>final<|message|>Sure, <b>bold</b>." if fmt.text_open else "Sure, <b>bold</b>."
    m = auto.new_matcher()
    assert m.accept_tokens(ids_of(tok, text)) and m.is_accepting  # free text alone
    m = auto.new_matcher()
    prefix = "" if fmt.text_open else "Let me check.\n"  # harmony: a final message or calls
    assert m.accept_tokens(ids_of(tok, prefix) + family_text(tok, good)), m.error
    assert m.is_accepting
    m = auto.new_matcher()
    assert not m.accept_tokens(ids_of(tok, prefix) + family_text(tok, [wrong["missing"]]))


def test_xml_string_values_are_free_text_up_to_their_closing_tag(family_compilers):
    tok, compiler = family_compilers["qwen3_coder"]
    spec = tool_call_spec([FAMILY_WEATHER], "required", parallel=False, fmt=tool_format(tok))
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    tail = "\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
    m = compiler.compile(spec).new_matcher()
    assert m.accept_tokens(family_text(tok, [], raw=head + "a </b>\n</param x" + tail)), m.error
    assert m.is_terminated
    m = compiler.compile(spec).new_matcher()  # the value ends at its first closing tag
    assert not m.accept_tokens(family_text(tok, [], raw=head + "a\n</parameter>\nb" + tail))
    m = compiler.compile(spec).new_matcher()  # forced: the call's start, a single tool's name, a first required key
    assert tok.decode(m.fast_forward_tokens()).startswith(head.rstrip())
