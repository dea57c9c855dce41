"""Tool formats by family: Qwen3-Coder XML, GLM-4.5, DeepSeek-V3/R1 and gpt-oss harmony.

Each family's tokenizer is SmolLM2's with the family's markers added as special tokens and a
small chat template, written here, in the family's tool format. The parser is fed token by
token (content, parallel calls, cut-off calls, a repeated call); a call as the template writes
it must parse back and be accepted by the forced grammar; and a tiny random-weight model
answers a forced call through the official openai SDK, streamed and not.
"""

from __future__ import annotations

import contextlib
import copy
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from grammars import GrammarCompiler, tool_call_spec, tool_format
from server.api.tool_calls import ToolCallParser
from server.engine.sequence import RequestOutput, TokenInfo
from server.model_loader import LoadedModel
from tests.inprocess import openai_client

_SYSTEM = """{%- if tools %}<|im_start|>system
You may call these functions:
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}"""

QWEN3_CODER_TEMPLATE = _SYSTEM + """To call one, reply with
<tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}
{%- for c in m.tool_calls or [] %}
{{- ('\\n' if not loop.first else '') + '<tool_call>\\n<function=' + c.function.name + '>\\n' }}
{%- for k, v in c.function.arguments.items() %}
{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- (m.content or '') + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

GLM45_TEMPLATE = _SYSTEM + """For each call write <tool_call>NAME
<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}
{%- for c in m.tool_calls or [] %}
{{- ('\\n' if not loop.first else '') + '<tool_call>' + c.function.name + '\\n' }}
{%- for k, v in c.function.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

DEEPSEEK_TEMPLATE = _SYSTEM + """<|im_end|>
{% endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}
{%- if m.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}
{%- for c in m.tool_calls %}
{{- ('\\n' if not loop.first else '') + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + c.function.name + '\\n```json\\n' }}
{{- c.function.arguments | tojson(separators=(',', ':')) }}
{{- '\\n```<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}{% endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

HARMONY_TEMPLATE = """<|start|>system<|message|>Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.tool_calls %}
{%- for c in m.tool_calls %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + c.function.name + ' <|constrain|>json<|message|>' }}
{{- c.function.arguments | tojson(separators=(',', ':')) }}{{- '<|call|>' }}
{%- endfor %}
{%- elif m.role == 'tool' %}{{- '<|start|>functions.tool to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{% endif %}"""

FAMILIES = {
    "qwen3_coder": (["<tool_call>", "</tool_call>"], QWEN3_CODER_TEMPLATE),
    "glm45": (["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"], GLM45_TEMPLATE),
    "deepseek": (["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                  "<｜tool▁calls▁end｜>"], DEEPSEEK_TEMPLATE),
    "harmony": (["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"], HARMONY_TEMPLATE),
}
PARALLEL = ["qwen3_coder", "glm45", "deepseek"]  # harmony: one call per turn (`<|call|>` ends it)


def family_tokenizer(tokenizer, family: str):
    """A copy of the SmolLM2 tokenizer with `family`'s markers and chat template."""
    markers, template = FAMILIES[family]
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = template
    return tok


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
# NOTE: the city holds a quote, a tag, a newline and the start of `</parameter>`: held back, then sent.
PARIS = ("get_weather", {"city": 'Pa"ris\n</par <b>', "days": 3, "unit": "c"})  # in schema order, as the grammar writes
CALLS = [PARIS, ("get_time", {}), ("get_weather", {"city": "Oslo", "unit": "f"})]


@pytest.fixture(scope="module")
def families(tokenizer):
    return {name: family_tokenizer(tokenizer, name) for name in FAMILIES}


def reply_ids(tok, calls, content: str = "Sure <b>.") -> list[int]:
    """A reply as the family writes it: `content`, then `calls` (harmony: the first call alone,
    after a thinking block and the `<|start|>assistant` it leaves)."""
    fmt = tool_format(tok)
    text = fmt.render(calls, {i: tok.convert_ids_to_tokens(i) for i in fmt.marker_ids})
    if fmt.name == "harmony":
        text = "<|channel|>analysis<|message|>Think <b>.<|end|><|start|>assistant" + text + "<|call|>"
    else:
        text = content + text
    return tok(text, add_special_tokens=False)["input_ids"]


def feed(tok, ids, finish_reason="stop"):
    """The parser fed one token at a time: (parser, finish reason, after each token what the
    client was sent, content and call index -> (name, arguments), and whether it `ended`)."""
    parser = ToolCallParser(tool_format(tok), at_start=False, tokenizer=tok, tools=[WEATHER, TIME])
    content, sent, steps = "", {}, []

    def apply(events):
        nonlocal content
        content += events.content
        for call in events.started:
            assert call.index not in sent and call.index == len(sent)  # indices in order, once each
            sent[call.index] = (call.name, "")
        for index, text in events.arguments.items():
            sent[index] = (sent[index][0], sent[index][1] + text)  # a name comes before its arguments

    for t in ids:
        apply(parser.feed(RequestOutput(tokens=[TokenInfo(t)])))
        steps.append((content, dict(sent), parser.ended))
    events, reason = parser.finish(finish_reason)
    apply(events)
    steps.append((content, dict(sent), parser.ended))
    return parser, reason, steps


def as_called(parser) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize("family", PARALLEL)
def test_parser_reads_parallel_calls_token_by_token(families, family):
    tok = families[family]
    parser, reason, steps = feed(tok, reply_ids(tok, CALLS))
    assert reason == "tool_calls" and parser.content == "Sure <b>." and not parser.ended
    assert as_called(parser) == CALLS and all(c.complete for c in parser.calls)
    final_content, final_sent, _ = steps[-1]
    assert final_sent == {c.index: (c.name, c.arguments) for c in parser.calls}
    for content, sent, _ in steps:  # nothing sent is ever taken back: each step extends the last
        assert final_content.startswith(content)
        assert all(final_sent[i][1].startswith(args) for i, (_, args) in sent.items())
    if tool_format(tok).params is not None:  # XML: the arguments stream as they are generated
        assert any(args == '{"city": "Pa' for _, sent, _ in steps for _, args in sent.values())


@pytest.mark.parametrize("family", PARALLEL)
def test_cut_inside_the_third_call_keeps_the_first_two_complete(families, family):
    tok = families[family]
    ids = reply_ids(tok, CALLS)
    whole, _, _ = feed(tok, ids)
    cut = next(n for n in range(len(ids)) if "Oslo" in tok.decode(ids[:n])) + 1  # just past "Oslo"
    parser, reason, _ = feed(tok, ids[:cut], "length")
    assert reason == "length" and [c.complete for c in parser.calls] == [True, True, False]
    assert [c.arguments for c in parser.calls[:2]] == [c.arguments for c in whole.calls[:2]]
    third = parser.calls[2]  # its arguments so far
    assert third.name == "get_weather" and '"Oslo' in third.arguments and third.arguments != whole.calls[2].arguments
    assert whole.calls[2].arguments.startswith(third.arguments)
    name_cut = next(n for n in range(len(ids)) if tok.decode(ids[:n]).count("get_weather") == 2) - 1
    parser, reason, _ = feed(tok, ids[:name_cut], "length")  # the third call's name is incomplete
    assert reason == "length" and as_called(parser) == CALLS[:2]


@pytest.mark.parametrize("family", PARALLEL)
def test_a_repeated_call_ends_the_turn_unsent(families, family):
    tok = families[family]
    other = ("get_weather", {"city": "Oslo", "unit": "f"})
    repeat = ("get_weather", {"unit": "c", "days": 3, "city": PARIS[1]["city"]})  # PARIS, keys reordered
    ids = reply_ids(tok, [PARIS, ("get_time", {}), other, repeat, ("get_time", {})])
    parser, reason, steps = feed(tok, ids, "length")
    assert parser.ended and reason == "tool_calls"
    assert as_called(parser) == [PARIS, ("get_time", {}), other]
    assert steps[-1][1] == {c.index: (c.name, c.arguments) for c in parser.calls}
    # the call named like an earlier one is sent whole once it differs: never a part of it
    assert {sent[2][1] for _, sent, _ in steps if 2 in sent} == {parser.calls[2].arguments}
    # `ended` turns True with the repeat's last token, before the output ends
    ended_at = next(n for n, (_, _, ended) in enumerate(steps, 1) if ended)
    assert tok.decode(ids[ended_at:]).lstrip("\n").startswith(("<tool_call>", "<｜tool▁call▁begin｜>"))


def test_harmony_reads_channels(families):
    tok = families["harmony"]
    parser, reason, steps = feed(tok, reply_ids(tok, [PARIS]))
    assert reason == "tool_calls" and parser.content == ""  # the analysis channel is not content
    assert as_called(parser) == [PARIS] and parser.calls[0].complete
    final = tok("<|channel|>final<|message|>Hi <b>!<|return|>", add_special_tokens=False)["input_ids"]
    parser, reason, _ = feed(tok, final)
    assert reason == "stop" and parser.content == "Hi <b>!" and not parser.calls
    ids = reply_ids(tok, [PARIS])
    cut = next(n for n in range(len(ids)) if tok.decode(ids[:n]).endswith('"unit'))
    parser, reason, _ = feed(tok, ids[:cut], "length")
    assert reason == "length" and parser.calls[0].arguments.endswith('"unit') and not parser.calls[0].complete


def render_reply(tok, calls) -> str:
    """What the family's chat template writes for an assistant turn of `calls`."""
    ask = [{"role": "user", "content": "Weather?"}]
    prompt = tok.apply_chat_template(ask, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}
    full = tok.apply_chat_template([*ask, turn], tools=[WEATHER, TIME], tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_templates_call_parses_back_and_fits_the_forced_grammar(families, family):
    tok = families[family]
    calls = CALLS[:1] if family == "harmony" else CALLS
    ids = tok(render_reply(tok, calls), add_special_tokens=False)["input_ids"]
    parser, reason, _ = feed(tok, ids)
    assert reason == "tool_calls" and as_called(parser) == calls and parser.content == ""
    compiler = GrammarCompiler(tok, len(tok), eos_token_ids=[2])
    m = compiler.compile(tool_call_spec([WEATHER, TIME], "required", fmt=tool_format(tok))).new_matcher()
    end = tok.convert_tokens_to_ids("<|call|>") if family == "harmony" else 2  # the turn's end token
    ids = ids[: ids.index(end)]
    assert m.accept_tokens(ids), m.error
    assert m.is_accepting


# ---------------------------------------------------------------- a tiny model per family


LOOKUP_PARAMS = {"type": "object", "properties": {
    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}, "exact": {"type": "boolean"}},
    "required": ["unit", "days", "exact"], "additionalProperties": False}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP_PARAMS}}
ASK = [{"role": "user", "content": "Look it up."}]


@contextlib.asynccontextmanager
async def sdk_for(tok):
    """The official AsyncOpenAI client on an in-process app serving a tiny random model."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2), dtype=torch.float32).eval()
    async with openai_client(LoadedModel(model, tok, "tiny", torch.device("cpu"), torch.float32, 2048)) as (client, _):
        yield client


@pytest.mark.anyio
@pytest.mark.parametrize("family", FAMILIES)
async def test_forced_call_through_the_sdk(families, family):
    # NOTE: harmony models think first (the analysis channel): a small budget ends the random
    # model's thinking, then the call follows the `<|start|>assistant` the thinking leaves.
    extra = {"max_reasoning_tokens": 4} if family == "harmony" else {}
    async with sdk_for(families[family]) as client:
        out = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=[LOOKUP], tool_choice="required", parallel_tool_calls=False,
            temperature=0, max_tokens=60, extra_body=extra)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments), LOOKUP_PARAMS)

        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=[LOOKUP], tool_choice="required", temperature=1, seed=1,
            max_tokens=60, stream=True, extra_body=extra)
        calls, finish = {}, None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            assert not delta.content
            for part in delta.tool_calls or []:
                if part.id:
                    assert part.index == len(calls) and part.function.name == "lookup"
                    calls[part.index] = ""
                calls[part.index] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert calls and finish in ("tool_calls", "length")
        complete = list(calls.values()) if finish == "tool_calls" else list(calls.values())[:-1]
        for arguments in complete:
            jsonschema.validate(json.loads(arguments), LOOKUP_PARAMS)

