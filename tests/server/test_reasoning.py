"""Thinking models end to end: reasoning apart from the answer (both fields, streamed and not),
the thinking budget enforced by the engine, a grammar that starts after the thinking, the
controls, and sessions whose template drops earlier thinking.

The models are tiny random Llamas over tokenizers carrying each family's markers, with chat
templates written in tests/thinking.py; the tests drive them into their markers with the
thinking budget (the engine forces the end marker) and grammars (the engine opens the
thinking before a grammar), so nothing depends on a random model choosing to think."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests import thinking
from tests.inprocess import openai_client

pytestmark = pytest.mark.anyio
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["answer"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def models(tokenizer):
    """family -> LoadedModel (tiny random weights, the family's markers and template)."""
    return {name: thinking.tiny_model(thinking.family_tokenizer(tokenizer, name)) for name in ("qwen3", "deepseek_r1")}


@pytest.fixture
def serve(models):
    """`serve(family, **settings)`: `openai_client` on an app serving that family's tiny model."""
    return lambda family, **settings: openai_client(models[family], **settings)


def fields(message) -> tuple[str | None, str | None, str | None]:
    extra = message.model_extra or {}
    return extra.get("reasoning_content"), extra.get("reasoning"), message.content


async def streamed(client, **kwargs) -> tuple[str, str, str, dict]:
    """(reasoning_content, reasoning, content, usage) joined from a stream's deltas."""
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    rc = r = content = ""
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            rc += extra.get("reasoning_content") or ""
            r += extra.get("reasoning") or ""
            content += choice.delta.content or ""
    return rc, r, content, usage


async def test_budget_cuts_the_thinking_at_exactly_n_tokens_and_the_answer_follows(serve):
    """DeepSeek-R1's template opens the thinking in the prompt: the budget's N tokens are all
    reasoning, the engine writes `</think>` as token N + 1, then the answer; reasoning_tokens
    = N + 1 and neither field holds a marker."""
    async with serve("deepseek_r1") as (client, _):
        for n in (0, 3, 7):
            out = await client.chat.completions.create(
                model="tiny-deepseek_r1", messages=ASK, temperature=0, max_tokens=20, logprobs=True,
                extra_body={"max_reasoning_tokens": n})
            check_cut(out, n)


async def test_budget_is_exact_with_speculative_decoding(serve):
    """A draft never runs past the budget: the token sampled after an accepted draft counts too."""
    async with serve("deepseek_r1", speculative="ngram") as (client, _):
        for n in (1, 2, 5, 9, 14):
            out = await client.chat.completions.create(
                model="tiny-deepseek_r1", messages=[{"role": "user", "content": "one two one two one two one two"}],
                temperature=0, max_tokens=24, logprobs=True, extra_body={"max_reasoning_tokens": n})
            check_cut(out, n)


def check_cut(out, n: int) -> None:
    """The thinking of `out` stopped at exactly `n` tokens, the engine's `</think>` next."""
    rc, r, content = fields(out.choices[0].message)
    tokens = [t.token for t in out.choices[0].logprobs.content]
    assert len(tokens) == out.usage.completion_tokens
    assert tokens[n] == "</think>" and "</think>" not in tokens[:n]
    assert out.usage.completion_tokens_details.reasoning_tokens == n + 1
    assert rc == r and (rc is None) == (n == 0)
    for text in (rc or "", content or ""):
        assert "<think>" not in text and "</think>" not in text


async def test_streamed_fields_equal_the_whole_ones(serve):
    async with serve("deepseek_r1") as (client, _):
        ask = dict(model="tiny-deepseek_r1", messages=ASK, temperature=0, max_tokens=24, extra_body={"max_reasoning_tokens": 6})
        whole = await client.chat.completions.create(**ask)
        rc, r, content = fields(whole.choices[0].message)
        s_rc, s_r, s_content, usage = await streamed(client, **ask)
        assert (s_rc, s_r, s_content) == (rc, r, content or "")
        assert rc and usage["completion_tokens_details"]["reasoning_tokens"] == 7


async def test_a_json_schema_after_thinking_is_valid_json_with_non_empty_reasoning(serve):
    """Qwen3 writes `<think>` itself: under a grammar the engine opens the thinking, which is
    free; the schema constrains only the answer after `</think>`."""
    async with serve("qwen3") as (client, _):
        for seed, budget in ((0, 5), (1, 5), (0, 0)):
            out = await client.chat.completions.create(
                model="tiny-qwen3", messages=ASK, temperature=1, seed=seed, max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                extra_body={"max_reasoning_tokens": budget})
            rc, r, content = fields(out.choices[0].message)
            assert rc == r and (bool(rc) == (budget > 0)) and "<think>" not in (rc or "")
            jsonschema.validate(json.loads(content), SCHEMA)
            assert out.choices[0].finish_reason == "stop"
            assert out.usage.completion_tokens_details.reasoning_tokens == budget + 2  # <think>, budget, </think>


async def test_a_forced_tool_call_after_thinking(serve):
    async with serve("qwen3") as (client, _):
        out = await client.chat.completions.create(
            model="tiny-qwen3", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            temperature=0, max_tokens=80, extra_body={"max_reasoning_tokens": 4})
        choice = out.choices[0]
        rc, _, _ = fields(choice.message)
        assert rc and "<tool_call>" not in rc
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


async def test_reasoning_effort_none_stops_a_model_that_cannot_switch_off(serve):
    async with serve("deepseek_r1") as (client, _):
        out = await client.chat.completions.create(
            model="tiny-deepseek_r1", messages=ASK, temperature=0, max_tokens=8, reasoning_effort="none")
        rc, r, content = fields(out.choices[0].message)
        assert rc is None and r is None and content
        assert out.usage.completion_tokens_details.reasoning_tokens == 1  # the forced </think>


async def test_qwen3_thinking_switched_off_parses_nothing(serve):
    async with serve("qwen3") as (client, http):
        out = await client.chat.completions.create(
            model="tiny-qwen3", messages=ASK, temperature=0, max_tokens=6, reasoning_effort="none")
        assert "reasoning_content" not in (out.choices[0].message.model_extra or {})
        bad = await http.post("/v1/chat/completions", json={
            "model": "tiny-qwen3", "messages": ASK, "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tools"
        big = await http.post("/v1/chat/completions", json={
            "model": "tiny-qwen3", "messages": ASK, "chat_template_kwargs": {"enable_thinking": True, "x" * 2000: 1}})
        assert big.status_code == 400 and big.json()["error"]["param"].startswith("chat_template_kwargs")


async def test_server_default_budget_and_parser_off(serve):
    async with serve("deepseek_r1", max_reasoning_tokens=2) as (client, _):
        out = await client.chat.completions.create(model="tiny-deepseek_r1", messages=ASK, temperature=0, max_tokens=10)
        assert out.usage.completion_tokens_details.reasoning_tokens == 3
    async with serve("deepseek_r1", reasoning_parser="none", max_reasoning_tokens=2) as (client, _):
        out = await client.chat.completions.create(model="tiny-deepseek_r1", messages=ASK, temperature=0, max_tokens=10)
        assert "reasoning_content" not in (out.choices[0].message.model_extra or {})
        assert out.usage.completion_tokens_details is None


def test_markers_written_as_several_tokens_never_leak(tokenizer):
    """SmolLM2's tokenizer has no `<think>` token: `</think>` is several tokens. The sequence
    holds a marker's first tokens back until it is complete (then neither text gets it) or
    turns out to be text (then the reasoning gets them), so no piece of a marker leaks."""
    from server.engine.reasoning import ReasoningSpec
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest, Sequence, TokenInfo

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    end_ids = tuple(encode("</think>"))
    assert len(end_ids) > 1
    spec = ReasoningSpec(tuple(encode("<think>")), end_ids, inside=True)
    seq = Sequence(GenerationRequest("r", [1], SamplingParams(max_tokens=64), reasoning=spec), tokenizer)
    chunks = [seq.append(TokenInfo(t)).output for t in encode("Sum it") + list(end_ids[:-1])]
    chunks += [seq.append(TokenInfo(t)).output for t in [end_ids[-1]] + encode(" Four.")]
    chunks.append(seq.flush())
    reasoning = "".join(c.reasoning for c in chunks)
    assert reasoning == "Sum it" and "".join(c.text for c in chunks) == " Four."
    assert all("<" not in c.text + c.reasoning for c in chunks)
    assert sum(len(c.tokens) for c in chunks) == len(seq.generated)
    assert seq.reasoning.tokens == len(encode("Sum it")) + len(end_ids) and seq.reasoning.thought == len(encode("Sum it"))
    # a marker's start that turns out to be text is reasoning after all
    seq = Sequence(GenerationRequest("r", [1], SamplingParams(max_tokens=64), reasoning=spec), tokenizer)
    chunks = [seq.append(TokenInfo(t)).output for t in encode("a") + list(end_ids[:-1]) + encode("x")]
    assert "".join(c.reasoning for c in chunks) + seq.flush().reasoning == tokenizer.decode(encode("a") + list(end_ids[:-1]) + encode("x"))


async def test_a_model_without_markers_answers_as_before(app_client):
    async with app_client() as client:
        out = (await client.post("/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "messages": ASK, "max_tokens": 4, "temperature": 0})).json()
        assert set(out["choices"][0]["message"]) == {"role", "content", "refusal"}
        assert "completion_tokens_details" not in out["usage"]


def history(responses: list, turns: int) -> list[dict]:
    """The messages of a chat's first `turns` turns as a client sends them back (each answer
    with its reasoning), ending with the next question."""
    messages = []
    for turn in range(turns + 1):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"})
        if turn < turns:
            rc, _, content = fields(responses[turn].choices[0].message)
            messages.append({"role": "assistant", "content": content or "", "reasoning_content": rc})
    return messages


async def chat_turns(client, model: str, turns: int, session: str, **body) -> list:
    """A `turns`-turn chat in `session`: each turn's response."""
    out = []
    for turn in range(turns):
        out.append(await client.chat.completions.create(
            model=model, messages=history(out, turn), temperature=0, max_tokens=24,
            extra_body={"max_reasoning_tokens": 5, "prompt_cache_key": session, **body}))
    return out


async def test_a_session_whose_template_drops_thinking_reuses_up_to_the_first_difference(serve, models):
    """DeepSeek-R1's template drops an answer's thinking from the history: turn N + 1's prompt
    first differs from the session's cached tokens where turn N's prompt opened `<think>`. The
    session reuses everything before that, and each answer equals a fresh prefill's."""
    tok = models["deepseek_r1"].tokenizer
    opened = len(tok.encode("<think>\n", add_special_tokens=False))
    async with serve("deepseek_r1") as (client, _):
        kept = await chat_turns(client, "tiny-deepseek_r1", 4, "s1")
        for before, after in zip(kept, kept[1:]):
            assert after.usage.prompt_tokens_details.cached_tokens == before.usage.prompt_tokens - opened
        for turn in range(1, 4):
            fresh = await client.chat.completions.create(
                model="tiny-deepseek_r1", messages=history(kept, turn), temperature=0, max_tokens=24,
                extra_body={"max_reasoning_tokens": 5, "prompt_cache_key": f"fresh-{turn}"})
            assert fresh.usage.prompt_tokens_details.cached_tokens == 0
            assert fresh.choices[0].message == kept[turn].choices[0].message


@pytest.fixture(scope="module")
def gpt_oss(tokenizer, models):
    models["gpt_oss"] = thinking.tiny_model(thinking.family_tokenizer(tokenizer, "gpt_oss"))
    return models["gpt_oss"]


async def test_harmony_analysis_is_reasoning_and_the_answer_is_the_final_channel(serve, gpt_oss):
    """gpt-oss: under a grammar the engine opens the analysis channel; the budget closes it with
    `<|end|>`; the JSON answer comes in the final channel (its header written by the grammar),
    and neither field holds a channel header."""
    async with serve("gpt_oss") as (client, _):
        ask = dict(model="tiny-gpt_oss", messages=ASK, temperature=0, max_tokens=60,
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                   extra_body={"max_reasoning_tokens": 4})
        out = await client.chat.completions.create(**ask)
        rc, r, content = fields(out.choices[0].message)
        assert rc and rc == r and "analysis" not in rc
        jsonschema.validate(json.loads(content), SCHEMA)
        assert out.usage.completion_tokens_details.reasoning_tokens == 3 + 4 + 1  # <|channel|>analysis<|message|>, 4, <|end|>
        s_rc, _, s_content, _ = await streamed(client, **ask)
        assert (s_rc, s_content) == (rc, content)


async def test_logprobs_change_no_token_of_a_thinking_turn(serve, gpt_oss):
    """With logprobs, the markers the engine forces (the end once the budget is spent, gpt-oss's
    three-token start under a grammar) are taken at their own positions with the model's
    logprob, a number, and no draw: a seeded turn's every token is the one it is without
    logprobs (issue 53's conformance check found `logprob: null` there). Under a grammar,
    greedy: its own forced tokens are drawn with logprobs and fast-forwarded without."""
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    for family, sampling in (("gpt_oss", {"temperature": 0, **schema}), ("deepseek_r1", {"temperature": 1, "seed": 0}),
                             ("deepseek_r1", {"temperature": 1, "seed": 1})):
        async with serve(family) as (client, _):
            ask = dict(model=f"tiny-{family}", messages=ASK, max_tokens=24, extra_body={"max_reasoning_tokens": 4}, **sampling)
            plain = await client.chat.completions.create(**ask)
            shown = await client.chat.completions.create(logprobs=True, top_logprobs=2, **ask)
            assert fields(shown.choices[0].message) == fields(plain.choices[0].message), (family, sampling)
            assert shown.usage.completion_tokens == plain.usage.completion_tokens, (family, sampling)
            tokens = shown.choices[0].logprobs.content
            assert len(tokens) == shown.usage.completion_tokens and all(isinstance(t.logprob, float) for t in tokens)
            assert fields(shown.choices[0].message)[0], (family, sampling)  # it thought: the markers were forced


async def test_responses_reasoning_items_events_and_a_continued_thinking_turn(serve):
    """The Responses API renders the same assembly: a reasoning item (its text as
    reasoning_text) before the message, reasoning_tokens in usage, the reasoning stream events;
    `previous_response_id` continues through the template (DeepSeek-R1 drops the thinking), and
    a reasoning item sent back as input is taken."""
    async with serve("deepseek_r1") as (client, _):
        ask = dict(model="tiny-deepseek_r1", input="What is 2 + 2?", temperature=0, max_output_tokens=20,
                   reasoning={"effort": "high"}, extra_body={"max_reasoning_tokens": 5})
        first = await client.responses.create(**ask)
        reasoning, message = first.output
        assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
        assert message.type == "message" and "</think>" not in message.content[0].text
        assert first.usage.output_tokens_details.reasoning_tokens == 6 and first.reasoning.effort == "high"
        events = [e async for e in await client.responses.create(stream=True, **ask)]
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == reasoning.content[0].text
        # each item closed before the next opens, as OpenAI streams them (issue 53)
        opened = [(e.type, e.output_index) for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
        assert opened == [("response.output_item.added", 0), ("response.output_item.done", 0),
                          ("response.output_item.added", 1), ("response.output_item.done", 1)], opened
        done = events[-1].response
        assert [i.type for i in done.output] == ["reasoning", "message"]
        assert done.output[0].content[0].text == reasoning.content[0].text and done.output[1].content[0].text == message.content[0].text
        second = await client.responses.create(model="tiny-deepseek_r1", input="And 3 + 3?", previous_response_id=first.id,
                                               temperature=0, max_output_tokens=20, extra_body={"max_reasoning_tokens": 5})
        assert second.usage.input_tokens_details.cached_tokens > 0 and second.output[0].type == "reasoning"
        sent_back = await client.responses.create(
            model="tiny-deepseek_r1", temperature=0, max_output_tokens=20, extra_body={"max_reasoning_tokens": 5},
            input=[{"role": "user", "content": "What is 2 + 2?"}, *[i.model_dump(exclude_none=True) for i in first.output],
                   {"role": "user", "content": "And 3 + 3?"}])
        assert [i.type for i in sent_back.output] == [i.type for i in second.output]
        assert sent_back.output[1].content[0].text == second.output[1].content[0].text


async def test_responses_reasoning_summary_is_the_reasoning_itself_when_asked(serve):
    async with serve("deepseek_r1") as (client, _):
        ask = dict(model="tiny-deepseek_r1", input="What is 2 + 2?", temperature=0, max_output_tokens=16,
                   reasoning={"effort": "high", "summary": "auto"}, extra_body={"max_reasoning_tokens": 4})
        out = await client.responses.create(**ask)
        assert out.output[0].summary[0].text == out.output[0].content[0].text and out.reasoning.summary == "auto"
        events = [e async for e in await client.responses.create(stream=True, **ask)]
        summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
        assert summary == out.output[0].content[0].text
        plain = await client.responses.create(**{**ask, "reasoning": {"effort": "high"}})
        assert plain.output[0].summary == []


@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1", "glm45", "smollm3", "gpt_oss"])
async def test_a_forced_tool_call_after_thinking_in_each_familys_format(tokenizer, models, serve, family):
    """Each thinking family's tiny model thinks (the engine opens the thinking where the
    template does not, the budget closes it), then calls in its own format: Hermes for Qwen3
    and SmolLM3, DeepSeek's markers, GLM-4.5's arg tags, harmony's commentary channel. No
    marker of either leaks into the fields, streamed or not."""
    if family not in models:
        models[family] = thinking.tiny_model(thinking.family_tokenizer(tokenizer, family))
    from grammars import tool_format

    fmt = tool_format(models[family].tokenizer)
    assert fmt is not None and fmt.name == {"qwen3": "hermes", "smollm3": "hermes", "deepseek_r1": "deepseek", "glm45": "glm45", "gpt_oss": "harmony"}[family]
    # NOTE: an enum: the XML formats' free-text values do not bound their length, and a
    # random-weight model's greedy string never ends
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
    async with serve(family) as (client, _):
        ask = dict(model=f"tiny-{family}", messages=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                   temperature=0, max_tokens=80, extra_body={"max_reasoning_tokens": 4})
        out = await client.chat.completions.create(**ask)
        choice = out.choices[0]
        rc, _, content = fields(choice.message)
        assert rc and choice.finish_reason == "tool_calls" and not content
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        stream = await client.chat.completions.create(stream=True, **ask)
        s_rc, args, names = "", "", []
        async for chunk in stream:
            for c in chunk.choices:
                s_rc += (c.delta.model_extra or {}).get("reasoning_content") or ""
                for t in c.delta.tool_calls or []:
                    names += [t.function.name] if t.function.name else []
                    args += t.function.arguments or ""
        assert (s_rc, names, args) == (rc, [call.function.name], call.function.arguments)


async def test_no_call_is_written_inside_the_thinking(serve, models):
    """With tools offered, the tool format's markers are masked while the model thinks: pushed
    up by a logit bias, `<tool_call>` still cannot appear in the thinking, and the call it starts
    comes after it, where the tool grammar reads it (a call inside the thinking would be lost)."""
    open_id = models["qwen3"].tokenizer.convert_tokens_to_ids("<tool_call>")
    async with serve("qwen3") as (client, _):
        out = await client.chat.completions.create(
            model="tiny-qwen3", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
            logit_bias={str(open_id): 100}, extra_body={"max_reasoning_tokens": 6})
        rc, _, _ = fields(out.choices[0].message)
        assert rc and "<tool_call>" not in rc and out.usage.completion_tokens_details.reasoning_tokens == 8
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.tool_calls
