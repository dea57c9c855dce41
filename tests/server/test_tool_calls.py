"""Tool calls: the output parser on hand-built outputs, chat-template round trips, and a tiny
random-weight model whose tokenizer carries Hermes markers, driven in-process by the official
openai SDK (the marker starts calls, so free text may start with `<`)."""

from __future__ import annotations

import contextlib
import copy
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from grammars import KVSERVE_FORMAT, tool_format
from server.model_loader import LoadedModel
from tests.inprocess import openai_client
from server.api.protocol import ChatCompletionRequest
from server.engine.sequence import RequestOutput, TokenInfo
from server.api import dialect
from server.api.serving_chat import render_prompt
from server.api.tool_calls import ToolCallParser

TWO_CALLS = (
    '<tool_call>{"name":"get_weather","arguments":{"city":"Pa\\"}{ris"}}</tool_call>\n'
    '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
)
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def parse(fmt, pieces, finish_reason, *, at_start=True, tokenizer=None):
    parser = ToolCallParser(fmt, at_start=at_start, tokenizer=tokenizer)
    events = [parser.feed(p) for p in pieces]
    last, reason = parser.finish(finish_reason)
    return parser, [*events, last], reason


def test_parser_streams_names_first_then_arguments_as_they_come():
    chunks = [RequestOutput(text=TWO_CALLS[i : i + 5]) for i in range(0, len(TWO_CALLS), 5)]
    parser, events, reason = parse(KVSERVE_FORMAT, chunks, "stop")
    assert reason == "tool_calls" and parser.content == ""
    assert [c.name for c in parser.calls] == ["get_weather", "get_time"]
    assert [c.index for c in parser.calls] == [0, 1] and len({c.id for c in parser.calls}) == 2
    assert json.loads(parser.calls[0].arguments) == {"city": 'Pa"}{ris'} and parser.calls[1].arguments == "{}"
    streamed = {0: "", 1: ""}
    for e in events:
        assert not e.content
        for call in e.started:  # the name comes before any of the call's arguments
            assert streamed[call.index] == ""
        for i, text in e.arguments.items():
            streamed[i] += text
    assert streamed == {0: parser.calls[0].arguments, 1: "{}"}


def test_parser_cut_off_calls_and_plain_text():
    cut, _, reason = parse(KVSERVE_FORMAT, [RequestOutput(text=TWO_CALLS[:60])], "length")
    assert reason == "length" and cut.content == "" and [c.name for c in cut.calls] == ["get_weather"]
    assert cut.calls[0].arguments == '{"city":"Pa\\"}{ris"}}'[: len(cut.calls[0].arguments)]
    wrapper, _, reason = parse(KVSERVE_FORMAT, [RequestOutput(text='<tool_call>{"na')], "length")
    assert reason == "length" and wrapper.content == "" and not wrapper.calls  # never the wrapper as text
    # cut at each character of a call's head: a call once its name is whole, its arguments as far as they got
    head = '<tool_call>{"name": "get_weather", "arguments": {"ci'
    for n in range(len(head) + 1):
        cut, events, reason = parse(KVSERVE_FORMAT, [RequestOutput(text=head[:n])], "length")
        assert reason == "length" and cut.content == "", n
        if n < head.index('get_weather"') + len('get_weather"'):
            assert not cut.calls, n
            continue
        [call] = cut.calls
        assert call.name == "get_weather" and not call.complete and '{"ci'.startswith(call.arguments), (n, call.arguments)
        assert [c.name for e in events for c in e.started] == ["get_weather"]
    text, _, reason = parse(KVSERVE_FORMAT, [RequestOutput(text="Hi <tool_call>"), RequestOutput(text="!")], "stop")
    assert reason == "stop" and text.content == "Hi <tool_call>!" and not text.calls


def test_a_turn_a_repeated_call_ended_is_completed_on_the_responses_api_whatever_the_limit():
    """The parser says "tool_calls" for a turn a repeated call ended, also when the token limit
    then cut the output (below); the Responses status follows it, as chat's finish_reason does."""
    from types import SimpleNamespace

    from server.api.serving_responses import status_of

    cut = RequestOutput(finish_reason="length")
    assert status_of(cut, SimpleNamespace(finish_reason="tool_calls")) == "completed"
    assert status_of(cut, SimpleNamespace(finish_reason="length")) == "incomplete"
    assert status_of(RequestOutput(finish_reason="stop"), SimpleNamespace(finish_reason="stop")) == "completed"


def test_parser_marks_complete_calls_and_ends_at_a_repeated_one():
    paris = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    oslo = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
    time_ = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    text = "\n".join([paris, time_, oslo, paris.replace('"Paris"', ' "Paris" '), time_])
    chunks = [RequestOutput(text=text[i : i + 3]) for i in range(0, len(text), 3)]
    parser, events, reason = parse(KVSERVE_FORMAT, chunks, "length")
    assert parser.ended and reason == "tool_calls"  # the repeat (same JSON) and all after it dropped
    assert [json.loads(c.arguments) for c in parser.calls] == [{"city": "Paris"}, {}, {"city": "Oslo"}]
    assert all(c.complete for c in parser.calls)
    oslo_events = [e for e in events if any(c.index == 2 for c in e.started) or 2 in e.arguments]
    assert len(oslo_events) == 1 and oslo_events[0].arguments[2] == '{"city":"Oslo"}'  # held, then sent whole
    cut, _, reason = parse(KVSERVE_FORMAT, [RequestOutput(text=text[: text.index("Oslo") + 2])], "length")
    assert reason == "length" and [c.complete for c in cut.calls] == [True, True, False]
    assert cut.calls[2].arguments == '{"city":"Os'  # a call named like an earlier one, cut: sent as far as it got
    again = "\n".join([paris, time_, paris])
    on_its_way, _, reason = parse(KVSERVE_FORMAT, [RequestOutput(text=again[: again.rindex("Paris")])], "length")
    assert reason == "tool_calls" and on_its_way.ended and len(on_its_way.calls) == 2  # cut while repeating


@pytest.fixture(scope="module")
def hermes_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.chat_template = HERMES_TEMPLATE
    return tok


HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Functions: {% for t in tools %}{{ t.function | tojson }}{% endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_parser_with_marker_tokens_ignores_marker_text(hermes_tokenizer):
    tok = hermes_tokenizer
    ids = tok('<b>x</b> "<tool_call>" text', add_special_tokens=False)["input_ids"]
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert open_id in ids  # the tokenizer matches marker text: the text before it is content
    ids = tok("<b>x</b>", add_special_tokens=False)["input_ids"] + [open_id]
    ids += tok('\n{"name":"get_time","arguments":{}}\n', add_special_tokens=False)["input_ids"] + [close_id]
    outputs = [RequestOutput(tokens=[TokenInfo(t)]) for t in ids]
    parser, _, reason = parse(tool_format(tok), outputs, "stop", at_start=False, tokenizer=tok)
    assert reason == "tool_calls" and parser.content == "<b>x</b>"
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", "{}")]


@pytest.mark.parametrize("marker, text", [
    ("<|python_tag|>", '{"name":"get_time","parameters":{}}; {"name":"get_weather","parameters":{"city":"Oslo"}}'),
    ("[TOOL_CALLS]", '[{"name":"get_time","arguments":{}}, {"name":"get_weather","arguments":{"city":"Oslo"}}]'),
])
def test_parser_reads_llama_and_mistral_blocks(tokenizer, marker, text):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [marker]})
    ids = tok("Sure.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(marker)]
    ids += tok(text, add_special_tokens=False)["input_ids"]
    outputs = [RequestOutput(tokens=[TokenInfo(t)]) for t in ids]
    parser, _, reason = parse(tool_format(tok), outputs, "stop", at_start=False, tokenizer=tok)
    assert reason == "tool_calls" and parser.content == "Sure."
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", "{}"), ("get_weather", '{"city":"Oslo"}')]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", **fields)


def round_trip_messages(arguments=('{"city":"Paris","unit":"c"}', "{}")):
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
             for i, (name, args) in enumerate(zip(("get_weather", "get_time"), arguments))]
    return [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "10:42"},
    ]


def test_several_calls_and_results_round_trip_through_templates(tokenizer, hermes_tokenizer):
    body = request(messages=round_trip_messages(), tools=[WEATHER, TIME])
    plain = tokenizer.decode(render_prompt(tokenizer, dialect.read(tokenizer).calls, body))  # SmolLM2: no tools in its template
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>') in plain
    assert "18 C" in plain and "10:42" in plain and "one such call per line" in plain
    hermes = hermes_tokenizer.decode(render_prompt(hermes_tokenizer, dialect.read(hermes_tokenizer).calls, body))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>') in hermes  # objects, not strings
    assert "18 C" in hermes and "10:42" in hermes and "one such call" not in hermes


# ---------------------------------------------------------------- a tiny model with markers


@pytest.fixture(scope="module")
def hermes_model(hermes_tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(hermes_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2), dtype=torch.float32).eval()
    return LoadedModel(model, hermes_tokenizer, "tiny-hermes", torch.device("cpu"), torch.float32, 2048)


@pytest.fixture
def sdk(hermes_model):
    """`async with sdk() as client`: the official AsyncOpenAI client on an in-process app."""

    @contextlib.asynccontextmanager
    async def make():
        async with openai_client(hermes_model) as (client, _):
            yield client

    return make


pytestmark = pytest.mark.anyio
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_marker_model_text_may_start_with_lt_and_calls_after_the_marker_are_valid(sdk, hermes_tokenizer):
    open_id = hermes_tokenizer.convert_tokens_to_ids("<tool_call>")
    async with sdk() as client:
        html = await client.chat.completions.create(
            model="tiny-hermes", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=6, logit_bias={"44": 100})
        assert html.choices[0].message.content.startswith("<") and not html.choices[0].message.tool_calls
        for seed in range(3):  # the marker (pushed up by the bias) starts a call whatever the model then writes
            out = await client.chat.completions.create(
                model="tiny-hermes", messages=ASK, tools=[WEATHER, TIME], temperature=1, seed=seed, max_tokens=40,
                logit_bias={str(open_id): 100}, parallel_tool_calls=False)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            schema = {"get_weather": PARAMS, "get_time": TIME["function"]["parameters"]}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        stream = await client.chat.completions.create(
            model="tiny-hermes", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=40, stream=True)
        heads, arguments, finish = [], "", None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            assert not delta.content
            for call in delta.tool_calls or []:
                if call.id:
                    heads.append((call.index, call.function.name))
                arguments += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert heads[0] == (0, "get_weather") and finish in ("tool_calls", "length")
        if finish == "tool_calls":
            assert [i for i, _ in heads] == list(range(len(heads)))


async def test_a_cut_in_the_third_parallel_call_keeps_the_first_two_complete_on_both_apis(sdk):
    """A seeded turn of three or more parallel calls, run again with a token limit that cuts
    inside its third call: chat returns the two complete calls and the cut one with its
    arguments so far (`length`); the Responses API marks the first two completed and the third
    incomplete (it used to drop the cut one and call the second incomplete)."""
    ask = dict(model="tiny-hermes", temperature=1, tools=[WEATHER, TIME], tool_choice="required")
    async with sdk() as client:
        for seed in range(40):
            full = await client.chat.completions.create(messages=ASK, seed=seed, max_tokens=200, **ask)
            whole = full.choices[0].message.tool_calls
            if len(whole) >= 3 and len({(c.function.name, c.function.arguments) for c in whole}) == len(whole):
                break
        else:
            pytest.skip("no seed gave three different calls")
        for cut in range(full.usage.completion_tokens - 1, 0, -1):  # the same draws up to any limit
            chat = await client.chat.completions.create(messages=ASK, seed=seed, max_tokens=cut, **ask)
            calls = chat.choices[0].message.tool_calls or []
            if len(calls) == 3 and calls[2].function.arguments != whole[2].function.arguments:
                break
        assert chat.choices[0].finish_reason == "length"
        assert [c.function.arguments for c in calls[:2]] == [c.function.arguments for c in whole[:2]]
        assert whole[2].function.arguments.startswith(calls[2].function.arguments)
        response = await client.responses.create(
            model="tiny-hermes", input=ASK[0]["content"], temperature=1, extra_body={"seed": seed}, max_output_tokens=cut,
            tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)], tool_choice="required")
        assert [(i.type, i.status) for i in response.output] == [("function_call", "completed")] * 2 + [("function_call", "incomplete")]
        assert [i.arguments for i in response.output] == [c.function.arguments for c in calls]
        assert response.status == "incomplete"


async def test_a_repeated_call_ends_the_turn_there(sdk):
    """Greedy, the tiny model writes the same call again and again: the repeat ends the turn's
    calls (dropped, finish_reason tool_calls) and the engine stops there, streamed or not."""
    ask = dict(model="tiny-hermes", messages=ASK, temperature=0, tools=[TIME], tool_choice="required", max_tokens=300)
    async with sdk() as client:
        out = await client.chat.completions.create(**ask)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls)
        assert out.usage.completion_tokens < 300  # stopped, not run to max_tokens
        stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask)
        heads, finish, usage = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                heads += [c.id for c in choice.delta.tool_calls or [] if c.id]
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and len(heads) == len(calls) and usage.completion_tokens < 300


async def test_a_repeated_call_stops_the_sequence_at_its_last_token_whatever_the_limit(hermes_model):
    """The engine stops a turn at the last token of the call that repeats an earlier one, not
    at the step where the client's events happen to be made: under any token limit above that
    token, every API counts the same tokens and ends the turn with its calls (issue 53: the
    Responses API said `incomplete` at a limit just above the call)."""
    function = {"type": "function", **TIME["function"]}
    anthropic_tool = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}
    asks = {
        "chat": lambda limit: ("/v1/chat/completions", {"messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": limit}),
        "responses": lambda limit: ("/v1/responses", {"input": ASK[0]["content"], "tools": [function], "tool_choice": "required",
                                                      "max_output_tokens": limit}),
        "messages": lambda limit: ("/v1/messages", {"messages": ASK, "tools": [anthropic_tool], "tool_choice": {"type": "any"},
                                                    "max_tokens": limit}),
    }
    ends = {"chat": lambda out: (out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]),
            "responses": lambda out: (out["status"], out["usage"]["output_tokens"]),
            "messages": lambda out: (out["stop_reason"], out["usage"]["output_tokens"])}
    ended = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}
    for settings in ({}, {"speculative": "ngram"}):  # drafts of the repeat run past its end: the stop is still there
        async with openai_client(hermes_model, **settings) as (_, http):
            for api, ask in asks.items():
                async def run(limit: int) -> tuple:
                    path, body = ask(limit)
                    out = await http.post(path, json={"model": "tiny-hermes", "temperature": 1, "seed": 1, **body})
                    assert out.status_code == 200, out.text
                    return ends[api](out.json())

                reason, n = await run(300)
                assert (reason, n) == (ended[api], 31), api  # seed 1 writes its one call twice (15 + 16 tokens): the repeat ended the turn
                for limit in (n, n + 1, n + 7, n + 16):
                    assert await run(limit) == (ended[api], n), (api, limit)


async def test_a_call_cut_at_each_token_of_its_head_comes_back_once_its_name_is_whole(sdk):
    """Cut by the token limit at each token of a call's head: nothing while its name is not
    whole, then the call with its arguments so far (empty up to its first argument), on chat
    and the Responses API alike, never the wrapper as content (issue 53: a cut between the name
    and `"arguments"` lost the call). Logprobs show the text each cut ended with."""
    import re

    ask = dict(model="tiny-hermes", temperature=0)
    tool = dict(tools=[WEATHER], tool_choice="required")
    function = {"type": "function", **WEATHER["function"]}
    named = re.compile(r'\{"name"\s*:\s*"get_weather"')
    async with sdk() as client:
        whole = await client.chat.completions.create(messages=ASK, max_tokens=300, **ask, **tool)
        (call,) = whole.choices[0].message.tool_calls
        cuts = {}
        for limit in range(1, whole.usage.completion_tokens):
            shown = (await client.chat.completions.create(messages=ASK, max_tokens=limit, logprobs=True, **ask, **tool)).choices[0]
            text = "".join(t.token for t in shown.logprobs.content)
            chat = (await client.chat.completions.create(messages=ASK, max_tokens=limit, **ask, **tool)).choices[0]
            response = await client.responses.create(input=ASK[0]["content"], max_output_tokens=limit, tools=[function],
                                                      tool_choice="required", **ask)
            assert chat.finish_reason == shown.finish_reason == "length" and not chat.message.content, limit
            assert response.status == "incomplete" and response.output_text == "", limit
            calls = [(c.function.name, c.function.arguments) for c in chat.message.tool_calls or []]
            assert [(c.function.name, c.function.arguments) for c in shown.message.tool_calls or []] == calls, limit
            assert [(i.name, i.arguments) for i in response.output if i.type == "function_call"] == calls, limit
            assert all(i.status == "incomplete" for i in response.output), limit
            assert bool(calls) == bool(named.search(text)), (limit, text)
            assert not calls or (calls[0][0] == "get_weather" and call.function.arguments.startswith(calls[0][1])), limit
            cuts[text] = calls
    name_only = [text for text, calls in cuts.items() if calls and '"arguments"' not in text]
    assert name_only and all(cuts[text] == [("get_weather", "")] for text in name_only)  # cut between its name and "arguments"
