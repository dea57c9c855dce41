"""Reasoning formats (server/api/reasoning.py) on the thinking families of tests/thinking.py:
detection and marker ids, whether a rendered prompt opens the thinking, the reasoning_effort
mapping and the chat_template_kwargs allow-list, and that each family's template in
tests/thinking.py renders a multi-turn chat the way the family does (earlier thinking
dropped where the family drops it). No model runs except one tiny forward pass."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from server.api.reasoning import (
    MAX_TEMPLATE_KWARGS_BYTES,
    ReasoningControlError,
    reads_variable,
    reasoning_format,
    starts_inside,
    template_kwargs,
)
from server.engine.core import end_of_turn_ids
from tests.thinking import BUILDERS, tiny_model

FAMILIES = list(BUILDERS)


@pytest.fixture(scope="module")
def toks(tokenizer) -> dict:
    return {family: build(tokenizer) for family, build in BUILDERS.items()}


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def prompt_ids(tok, messages, **kwargs) -> list[int]:
    return tok(render(tok, messages, **kwargs), add_special_tokens=False)["input_ids"]


def ids(tok, *tokens) -> tuple[int, ...]:
    return tuple(tok.convert_tokens_to_ids(list(tokens)))


ASK = [{"role": "user", "content": "Hi"}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me.", "thinking": "The user greets me."},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOL_LOOP = [  # the assistant's turn after the last user message is still going: its thinking is current
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "thinking": "Need the weather.",
     "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
]


# ---------------------------------------------------------------- detection and marker ids


def test_plain_smollm2_has_no_format(tokenizer):
    assert reasoning_format(tokenizer, None) is None
    assert reasoning_format(tokenizer, "none") is None


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_detected_with_its_marker_ids(toks, family):
    tok = toks[family]
    fmt = reasoning_format(tok, None)
    assert fmt.name == family
    if family == "gpt_oss":
        analysis = tuple(tok.encode("analysis", add_special_tokens=False))
        final = tuple(tok.encode("final", add_special_tokens=False))
        assert fmt.start_ids == (*ids(tok, "<|channel|>"), *analysis, *ids(tok, "<|message|>"))
        assert fmt.end_ids == ids(tok, "<|end|>")
        assert fmt.answer_ids == (*ids(tok, "<|channel|>"), *final, *ids(tok, "<|message|>"))
    else:
        assert (fmt.start, fmt.end) == ("<think>", "</think>")
        assert fmt.start_ids == ids(tok, "<think>") and fmt.end_ids == ids(tok, "</think>")
        assert len(fmt.start_ids) == len(fmt.end_ids) == 1 and fmt.answer_ids == ()
    assert set(tok.encode("\n\n", add_special_tokens=False)) <= fmt.blank_ids
    assert not fmt.blank_ids & set(fmt.start_ids + fmt.end_ids)


def test_names_aliases_and_unknown_names(tokenizer, toks):
    plain = reasoning_format(tokenizer, "qwen3")  # markers as plain text: several ids each
    assert plain.start_ids == tuple(tokenizer.encode("<think>", add_special_tokens=False)) and len(plain.start_ids) > 1
    assert reasoning_format(toks["gpt_oss"], "openai_gptoss").name == "gpt_oss"
    assert reasoning_format(toks["deepseek_r1"], "DeepSeek-R1").name == "deepseek_r1"
    assert reasoning_format(toks["qwen3"], "none") is None
    with pytest.raises(ValueError, match="known: qwen3, deepseek_r1, glm45, smollm3, gpt_oss, none"):
        reasoning_format(toks["qwen3"], "granite")


def test_a_template_that_mentions_think_is_enough(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<think>\n{% endif %}"
    fmt = reasoning_format(tok, None)
    assert fmt.name == "qwen3" and fmt.start_ids == tuple(tok.encode("<think>", add_special_tokens=False))
    assert starts_inside(fmt, prompt_ids(tok, ASK))


# ---------------------------------------------------------------- where the output starts


@pytest.mark.parametrize("family, kwargs, tail, inside", [
    ("qwen3", {}, "<|im_start|>assistant\n", False),  # the model writes <think> itself
    ("qwen3", {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("deepseek_r1", {}, "<｜Assistant｜><think>\n", True),
    ("gpt_oss", {}, "<|end|><|start|>assistant", False),
    ("glm45", {}, "<|user|>\nHi<|assistant|>", False),
    ("glm45", {"enable_thinking": False}, "<|user|>\nHi/nothink<|assistant|>\n<think></think>", False),
    ("smollm3", {}, "<|im_start|>assistant\n", False),
    ("smollm3", {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n", False),
])
def test_starts_inside_each_generation_prompt(toks, family, kwargs, tail, inside):
    tok = toks[family]
    assert render(tok, ASK, **kwargs).endswith(tail)
    assert starts_inside(reasoning_format(tok, None), prompt_ids(tok, ASK, **kwargs)) is inside


def test_starts_inside_on_hand_built_tails(toks):
    tok = toks["qwen3"]
    fmt = reasoning_format(tok, None)
    (think,), (end,) = fmt.start_ids, fmt.end_ids
    nl, nlnl = tok.encode("\n", add_special_tokens=False) + tok.encode("\n\n", add_special_tokens=False)
    assert starts_inside(fmt, [5, think]) and starts_inside(fmt, [5, think, nl, nlnl])
    assert not starts_inside(fmt, [5, think, nl, nl, end, nlnl])  # a closed, empty block
    assert not starts_inside(fmt, [think, 5]) and not starts_inside(fmt, [nl]) and not starts_inside(fmt, [])
    harmony = reasoning_format(toks["gpt_oss"], None)
    assert starts_inside(harmony, [7, *harmony.start_ids]) and not starts_inside(harmony, list(harmony.start_ids[1:]))


# ---------------------------------------------------------------- controls


@pytest.mark.parametrize("family, effort, kwargs, budget", [
    ("qwen3", "none", {"enable_thinking": False}, None),
    ("qwen3", "minimal", {"enable_thinking": False}, None),
    ("qwen3", "low", {"enable_thinking": True}, None),
    ("qwen3", "high", {"enable_thinking": True}, None),
    ("glm45", "none", {"enable_thinking": False}, None),
    ("glm45", "medium", {"enable_thinking": True}, None),
    ("smollm3", "minimal", {"enable_thinking": False}, None),
    ("smollm3", "high", {"enable_thinking": True}, None),
    ("gpt_oss", "none", {"reasoning_effort": "low"}, 0),
    ("gpt_oss", "minimal", {"reasoning_effort": "low"}, None),
    ("gpt_oss", "medium", {"reasoning_effort": "medium"}, None),
    ("gpt_oss", "high", {"reasoning_effort": "high"}, None),
    ("deepseek_r1", "none", {}, 0),  # no switch: the engine forces </think> at once
    ("deepseek_r1", "minimal", {}, 0),
    ("deepseek_r1", "high", {}, None),
])
def test_reasoning_effort_maps_per_family(toks, family, effort, kwargs, budget):
    tok = toks[family]
    fmt = reasoning_format(tok, None)
    assert template_kwargs(fmt, tok, effort, None) == (kwargs, budget)
    assert template_kwargs(fmt, tok, None, None) == ({}, None)


def test_effort_kwargs_change_the_rendered_prompt(toks):
    def prompt(family, effort):
        tok = toks[family]
        kwargs, _ = template_kwargs(reasoning_format(tok, None), tok, effort, None)
        return render(tok, ASK, **kwargs)

    assert "Reasoning: high\n" in prompt("gpt_oss", "high") and "Reasoning: low\n" in prompt("gpt_oss", "none")
    assert prompt("qwen3", "none").endswith("<think>\n\n</think>\n\n") and prompt("qwen3", "low").endswith("assistant\n")
    assert "Reasoning Mode: /no_think" in prompt("smollm3", "minimal")
    assert prompt("glm45", "none").endswith("<think></think>")


def test_a_model_without_a_format_ignores_the_effort(tokenizer):
    assert template_kwargs(None, tokenizer, "none", None) == ({}, None)
    assert template_kwargs(None, tokenizer, "high", {"enable_thinking": True}) == ({"enable_thinking": True}, None)
    with pytest.raises(ReasoningControlError) as error:
        template_kwargs(None, tokenizer, "max", None)
    assert error.value.param == "reasoning_effort" and error.value.key is None


@pytest.mark.parametrize("family, effort, explicit, expected", [
    ("qwen3", "none", {"enable_thinking": True}, ({"enable_thinking": True}, None)),
    ("qwen3", None, {"enable_thinking": False}, ({"enable_thinking": False}, None)),
    ("qwen3", "low", {"preserve_thinking": True}, ({"enable_thinking": True, "preserve_thinking": True}, None)),
    ("gpt_oss", "none", {"reasoning_effort": "high"}, ({"reasoning_effort": "high"}, None)),
    ("deepseek_r1", "none", {"clear_thinking": True}, ({"clear_thinking": True}, 0)),  # not a switch
    ("deepseek_r1", "high", {"enable_thinking": False}, ({"enable_thinking": False}, 0)),  # unread: budget
    ("gpt_oss", None, {"thinking": False}, ({"thinking": False}, 0)),
])
def test_explicit_template_kwargs_win_over_effort(toks, family, effort, explicit, expected):
    tok = toks[family]
    assert template_kwargs(reasoning_format(tok, None), tok, effort, explicit) == expected


def test_template_kwargs_must_fit_the_size_bound(toks):
    tok = toks["qwen3"]
    fmt = reasoning_format(tok, None)
    key = "model_identity"
    overhead = len(json.dumps({key: ""}, separators=(",", ":")))
    at_bound = {key: "x" * (MAX_TEMPLATE_KWARGS_BYTES - overhead)}
    with pytest.raises(ReasoningControlError) as error:  # within the bound: refused for its key
        template_kwargs(fmt, tok, None, at_bound)
    assert (error.value.key, error.value.param) == (key, f"chat_template_kwargs.{key}")
    with pytest.raises(ReasoningControlError) as error:
        template_kwargs(fmt, tok, None, {key: "x" * (MAX_TEMPLATE_KWARGS_BYTES - overhead + 1)})
    assert (error.value.key, error.value.param) == (None, "chat_template_kwargs")
    assert "1025 bytes" in str(error.value)


@pytest.mark.parametrize("kwargs, key", [
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"tools": []}, "tools"),
    ({"enable_thinking": True, "builtin_tools": ["python"]}, "builtin_tools"),
    ({"enable_thinking": "false"}, "enable_thinking"),
    ({"enable_thinking": 0}, "enable_thinking"),
    ({"enable_thinking": None}, "enable_thinking"),
    ({"reasoning_effort": "none"}, "reasoning_effort"),
    ({"preserve_thinking": "yes"}, "preserve_thinking"),
])
def test_template_kwargs_outside_the_allow_list_are_refused(toks, kwargs, key):
    tok = toks["qwen3"]
    with pytest.raises(ReasoningControlError) as error:
        template_kwargs(reasoning_format(tok, None), tok, "high", kwargs)
    assert isinstance(error.value, ValueError)
    assert (error.value.key, error.value.param) == (key, f"chat_template_kwargs.{key}")


def test_template_kwargs_must_be_an_object(toks):
    tok = toks["qwen3"]
    with pytest.raises(ReasoningControlError) as error:
        template_kwargs(reasoning_format(tok, None), tok, None, ["enable_thinking"])
    assert (error.value.key, error.value.param) == (None, "chat_template_kwargs")


def test_reads_variable_ignores_attributes_strings_and_text():
    assert reads_variable("{% if thinking %}x{% endif %}", "thinking")
    assert reads_variable("{{- 'Reasoning: ' + reasoning_effort }}", "reasoning_effort")
    assert not reads_variable("{{ message.thinking }}{% if 'thinking' in m %}{% endif %}", "thinking")
    assert not reads_variable("a thinking process {{ enable_thinking }}{# thinking #}", "thinking")
    assert not reads_variable("{{ \"don't thinking\" }}", "thinking")


# ---------------------------------------------------------------- each template's multi-turn chat

EXPECTED_CHAT = {
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
             "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
             "<|im_start|>assistant\n",
    "deepseek_r1": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
                   "<｜User｜>Weather in Paris?<｜Assistant｜><think>\n",
    "gpt_oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
               "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n# Valid channels: "
               "analysis, commentary, final. Channel must be included for every message.<|end|>"
               "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|><|start|>user<|message|>Hi<|end|>"
               "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
               "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant",
    "glm45": "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think></think>\nHello!"
             "<|user|>\nWeather in Paris?<|assistant|>",
    "smollm3": "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /think\n\n"
               "## Custom Instructions\n\nBe brief.\n\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
               "<|im_start|>assistant\n",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_template_drops_earlier_thinking(toks, family):
    assert render(toks[family], CHAT) == EXPECTED_CHAT[family]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1", "glm45"])
def test_thinking_written_in_content_is_dropped_too(toks, family):
    chat = [*CHAT[:2], {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello!"}, CHAT[3]]
    text = render(toks[family], chat)
    assert "greets" not in text and "Hello!" in text


def test_qwen3_keeps_thinking_after_the_last_query_or_when_preserved(toks):
    tok = toks["qwen3"]
    loop = render(tok, TOOL_LOOP)
    assert loop.endswith(
        "<|im_start|>assistant\n<think>\nNeed the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    kept = render(tok, CHAT, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nThe user greets me.\n</think>\n\nHello!<|im_end|>" in kept


def test_glm45_keeps_thinking_after_the_last_user(toks):
    text = render(toks["glm45"], TOOL_LOOP)
    assert text.endswith(
        "<|assistant|>\n<think>Need the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n</tool_call><|observation|>\n<tool_response>\n18 C\n</tool_response><|assistant|>")


def test_gpt_oss_keeps_analysis_only_for_a_pending_call(toks):
    tok = toks["gpt_oss"]
    pending = render(tok, TOOL_LOOP)
    assert pending.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|><|start|>assistant')
    answered = render(tok, [*TOOL_LOOP, {"role": "assistant", "content": "18 C."}, {"role": "user", "content": "Thanks"}])
    assert "Need the weather." not in answered and "<|channel|>final<|message|>18 C.<|end|>" in answered


def test_deepseek_r1_and_smollm3_never_render_reasoning_content(toks):
    for family in ("deepseek_r1", "smollm3"):
        assert "Need the weather." not in render(toks[family], TOOL_LOOP)
    r1 = render(toks["deepseek_r1"], TOOL_LOOP)
    assert r1.endswith("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                       '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
                       "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
                       "<｜Assistant｜><think>\n")


def test_smollm3_system_flag_switches_the_mode(toks):
    text = render(toks["smollm3"], [{"role": "system", "content": "Be brief. /no_think"}, *CHAT[1:]])
    assert "Reasoning Mode: /no_think" in text and "Be brief.\n\n<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\n\n</think>\nHello!<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")


@pytest.mark.parametrize("family", ["qwen3", "glm45", "gpt_oss"])
def test_kept_thinking_tokenizes_to_the_format_markers(toks, family):
    tok = toks[family]
    fmt = reasoning_format(tok, None)
    prompt = prompt_ids(tok, TOOL_LOOP)
    start = next(i for i in range(len(prompt)) if tuple(prompt[i:i + len(fmt.start_ids)]) == fmt.start_ids)
    start += len(fmt.start_ids)
    end = next(i for i in range(start, len(prompt)) if tuple(prompt[i:i + len(fmt.end_ids)]) == fmt.end_ids)
    assert tok.decode(prompt[start:end]).strip() == "Need the weather."


# ---------------------------------------------------------------- the tiny model


@pytest.mark.parametrize("family, ends", [
    ("gpt_oss", ("<|return|>", "<|call|>")),
    ("glm45", ("<|user|>", "<|observation|>", "<|endoftext|>")),
    ("deepseek_r1", ("<｜end▁of▁sentence｜>",)),
])
def test_tiny_model_covers_the_vocabulary_and_ends_turns_on_the_family_tokens(toks, family, ends):
    tok = toks[family]
    loaded = tiny_model(tok)
    assert loaded.model.config.vocab_size == len(tok) and loaded.model_id == f"tiny-{family}"
    assert end_of_turn_ids(loaded.model, tok) == frozenset(ids(tok, *ends)) | {tok.eos_token_id}
    prompt = torch.tensor([prompt_ids(tok, ASK)])
    assert loaded.model(prompt).logits.shape == (1, prompt.shape[1], len(tok))
    again = tiny_model(tok, seed=0).model.lm_head.weight
    assert torch.equal(loaded.model.lm_head.weight, again)
    assert not torch.equal(tiny_model(tok, seed=1).model.lm_head.weight, again)
