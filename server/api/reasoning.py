"""A thinking model's reasoning markers, and the request controls that switch its thinking.

**Formats.** A reasoning format is a parser name and the two markers that bracket the
thinking, as token ids of this tokenizer (`encode(marker, add_special_tokens=False)`: one id
when the marker is an added token, several when it is plain text). Names follow vLLM's
reasoning parsers where it has one:

    qwen3, deepseek_r1, glm45, smollm3   <think> ... </think>
    gpt_oss                              <|channel|>analysis<|message|> ... <|end|>   (harmony)

(`openai_gptoss`, vLLM's name for the harmony parser, is accepted for `gpt_oss`; `-` and `_`
are one.) In harmony the thinking is the `analysis` channel; after its `<|end|>` the model
writes `<|start|>assistant<|channel|>final<|message|>` and then the answer (`answer_ids`).

`reasoning_format(tokenizer, None)` detects the format: harmony's `<|channel|>`,
`<|message|>` and `<|end|>` among the added tokens -> gpt_oss; `<think>` and `</think>` as
added tokens, or a chat template that mentions `<think>` -> a `<think>` family, named from
the template (DeepSeek's `<｜Assistant｜>`, GLM's `<|assistant|>`/`[gMASK]`, SmolLM3's
`/no_think`; otherwise qwen3). Anything else (SmolLM2) has no format: None, and the server
behaves as without reasoning. The name "none" turns parsing off; an unknown name is a
ValueError that lists the known ones.

**Where the output starts.** `starts_inside` says whether the rendered prompt already opened
the thinking: DeepSeek-R1's template ends the generation prompt with `<think>\\n`, so the first
generated token is thinking. Trailing whitespace-only tokens are skipped; a prompt that ends
with a closed empty block (Qwen3 with thinking off renders `<think>\\n\\n</think>\\n\\n`, GLM-4.5
`<think></think>`) is not inside.

**Controls.** `template_kwargs` turns a request's `reasoning_effort` and `chat_template_kwargs`
into the keyword arguments for `apply_chat_template` and a thinking-budget override. How a
family switches thinking is read from its template's source (which variables it reads):

    effort          enable_thinking / thinking   reasoning_effort (gpt-oss)   no switch (DeepSeek-R1)
    none            False                        "low", budget 0              budget 0
    minimal         False                        "low"                        budget 0
    low/medium/high True                         the same level               -

A budget of 0 makes the engine force the end marker at once: the only way to stop a family
that cannot switch thinking off from thinking. A model without a format ignores the effort.

`chat_template_kwargs` pass to the template from an allow-list of what thinking templates
read: `enable_thinking` (Qwen3, GLM-4.5, SmolLM3), `thinking` (DeepSeek-V3.1, Granite),
`preserve_thinking` (Qwen3.6: keep earlier turns' thinking), `clear_thinking` (GLM-4.7: the
same, inverted) as booleans, and `reasoning_effort` (gpt-oss) as low/medium/high; at most
`MAX_TEMPLATE_KWARGS_BYTES` of compact JSON. Anything else is refused with a
`ReasoningControlError` naming the parameter (`chat_template_kwargs.<key>`): the rest of a
template's variables (`messages`, `tools`, `add_generation_prompt`, `builtin_tools`,
`model_identity`, ...) are either the server's to set or would let a client rewrite the
system prompt. Explicit kwargs win over `reasoning_effort`: a request that sets a switch
(`enable_thinking`, `thinking`, `reasoning_effort`) gets no budget from its effort, and one
that turns `enable_thinking`/`thinking` off on a template that does not read it gets budget 0.

**One request.** `controls` applies the above to a request (a 400 naming the field for a
refused control) and settles its thinking budget: the request's `max_reasoning_tokens`, else
what its effort implies, else the server's `--max-reasoning-tokens`. `spec` reads the rendered
prompt for the engine's `ReasoningSpec`: the output starts inside the thinking, before it (the
model may open it), or with thinking switched off (`switched_off`: the template closed an
empty block; no reasoning parsing then). While thinking, the model may not write the tool
format's markers: a call inside the thinking would be lost, so calls are kept to the answer,
where the tool grammar reads them.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from server.api.errors import APIError
from server.engine.reasoning import ReasoningSpec

THINK_FAMILIES = ("qwen3", "deepseek_r1", "glm45", "smollm3")
GPT_OSS = "gpt_oss"
KNOWN = (*THINK_FAMILIES, GPT_OSS)
ALIASES = {"openai_gptoss": GPT_OSS}
THINK = ("<think>", "</think>")
HARMONY = ("<|channel|>analysis<|message|>", "<|end|>")
HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>")
HARMONY_ANSWER = "<|channel|>final<|message|>"

EFFORTS = ("none", "minimal", "low", "medium", "high")
LEVELS = ("low", "medium", "high")
SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")  # in the order a template is asked
TEMPLATE_KWARGS: dict[str, tuple] = {  # key -> allowed values
    "enable_thinking": (True, False),
    "thinking": (True, False),
    "preserve_thinking": (True, False),
    "clear_thinking": (True, False),
    "reasoning_effort": LEVELS,
}
MAX_TEMPLATE_KWARGS_BYTES = 1024
# NOTE: what templates write around a marker; every token of these encodings is blank.
_BLANKS = ("\n", "\n\n", "\n\n\n", " ", "  ", " \n", "\n ", "\t", "\r\n")


class ReasoningControlError(ValueError):
    """A reasoning control the server refuses: `param` names it for the 400
    (`reasoning_effort`, `chat_template_kwargs`, `chat_template_kwargs.<key>`); `key` is the
    offending chat_template_kwargs key (None: not one key)."""

    def __init__(self, message: str, *, param: str, key: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.key = key


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One tokenizer's reasoning markers (see the module docstring)."""

    name: str  # the parser name
    start: str  # marker text
    end: str
    start_ids: tuple[int, ...]  # marker ids as this tokenizer encodes them
    end_ids: tuple[int, ...]
    blank_ids: frozenset[int]  # whitespace-only tokens (may sit between a marker and text)
    answer_ids: tuple[int, ...] = ()  # harmony: the answer starts after these (after end_ids)


def reasoning_format(tokenizer, name: str | None) -> ReasoningFormat | None:
    """The tokenizer's format: `name` None detects it (None when the model does not think),
    "none" is None, a known name is that format; ValueError for any other name."""
    if name is None:
        name = _detect(tokenizer)
        if name is None:
            return None
    else:
        key = name.strip().lower().replace("-", "_")
        key = ALIASES.get(key, key)
        if key == "none":
            return None
        if key not in KNOWN:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(KNOWN)}, none")
        name = key
    start, end = HARMONY if name == GPT_OSS else THINK
    return ReasoningFormat(
        name=name,
        start=start,
        end=end,
        start_ids=_ids(tokenizer, start),
        end_ids=_ids(tokenizer, end),
        blank_ids=_blank_ids(tokenizer),
        answer_ids=_ids(tokenizer, HARMONY_ANSWER) if name == GPT_OSS else (),
    )


def starts_inside(fmt: ReasoningFormat, prompt_ids) -> bool:
    """The prompt opened the thinking: it ends with the start marker, maybe followed by
    whitespace-only tokens (then the output starts thinking, with no start marker of its own).
    A prompt ending with a closed block (`<think>\\n\\n</think>\\n\\n`) is not inside."""
    return _ends_with(fmt, prompt_ids, fmt.start_ids)


def _ends_with(fmt: ReasoningFormat, prompt_ids, marker: tuple[int, ...]) -> bool:
    """The prompt ends with `marker`, maybe followed by whitespace-only tokens."""
    end = len(prompt_ids)
    while end and prompt_ids[end - 1] in fmt.blank_ids:
        end -= 1
    return end >= len(marker) and tuple(prompt_ids[end - len(marker):end]) == marker


def template_kwargs(
    fmt: ReasoningFormat | None, tokenizer, reasoning_effort: str | None, chat_template_kwargs: dict | None
) -> tuple[dict, int | None]:
    """(kwargs for `apply_chat_template`, thinking budget override or None), from the request's
    `reasoning_effort` mapped for this template and its checked `chat_template_kwargs`, which
    win. Raises ReasoningControlError for a value or key outside the allow-list."""
    explicit = checked_template_kwargs(chat_template_kwargs)
    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise ReasoningControlError(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, not {reasoning_effort!r}", param="reasoning_effort")
    if fmt is None:
        return explicit, None
    source = template_source(tokenizer)
    if any(key in explicit for key in SWITCHES):
        off = [key for key in ("enable_thinking", "thinking") if explicit.get(key) is False]
        unread = off and not any(reads_variable(source, key) for key in off)
        return explicit, 0 if unread else None
    if reasoning_effort is None:
        return explicit, None
    kwargs, budget = _effort(source, reasoning_effort)
    return {**kwargs, **explicit}, budget


def checked_template_kwargs(kwargs: dict | None) -> dict:
    """The request's chat_template_kwargs, checked against the allow-list and size bound."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ReasoningControlError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        size = len(json.dumps(kwargs, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError):
        raise ReasoningControlError("chat_template_kwargs must be JSON", param="chat_template_kwargs") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ReasoningControlError(
            f"chat_template_kwargs is {size} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES} are accepted",
            param="chat_template_kwargs")
    for key, value in kwargs.items():
        allowed = TEMPLATE_KWARGS.get(key)
        param = f"chat_template_kwargs.{key}"
        if allowed is None:
            raise ReasoningControlError(
                f"chat_template_kwargs.{key} is not accepted; accepted keys: {', '.join(TEMPLATE_KWARGS)}",
                param=param, key=key)
        if not any(type(value) is type(a) and value == a for a in allowed):
            shown = "true or false" if allowed == (True, False) else ", ".join(map(str, allowed))
            raise ReasoningControlError(f"chat_template_kwargs.{key} must be {shown}", param=param, key=key)
    return dict(kwargs)


# -- one request ---------------------------------------------------------------------------------


def controls(ctx, effort: str | None, request_kwargs: dict | None, requested_budget: int | None) -> tuple[dict, int | None]:
    """(kwargs for the chat template, thinking budget or None: unbounded)."""
    try:
        kwargs, implied = template_kwargs(ctx.reasoning, ctx.tokenizer, effort, request_kwargs)
    except ReasoningControlError as exc:
        raise APIError(400, str(exc), code="invalid_value", param=exc.param, rejection="bad_request") from None
    if requested_budget is not None:
        return kwargs, requested_budget
    return kwargs, implied if implied is not None else ctx.max_reasoning_tokens


def spec(ctx, prompt_ids: list[int], budget: int | None, tool_mode: str | None) -> ReasoningSpec | None:
    """The engine's reasoning spec for a prompt (None: the model does not think, or its
    template switched thinking off)."""
    fmt = ctx.reasoning
    if fmt is None or switched_off(fmt, prompt_ids):
        return None
    banned = frozenset()
    if tool_mode is not None:
        banned = ctx.dialect.calls.marker_ids - set(fmt.end_ids) - set(fmt.start_ids) - ctx.engine.eos_ids
    return ReasoningSpec(fmt.start_ids, fmt.end_ids, inside=starts_inside(fmt, prompt_ids), budget=budget,
                         banned_ids=banned, blank_ids=fmt.blank_ids)


def switched_off(fmt, prompt_ids: list[int]) -> bool:
    """The template closed an empty thinking block at the end of the prompt (Qwen3 with
    `enable_thinking` false: `<think>\\n\\n</think>\\n\\n`): the model answers at once."""
    return _ends_with(fmt, prompt_ids, fmt.end_ids)


def template_source(tokenizer) -> str:
    """The chat template's source ("" without one; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template or ""


_TAG = re.compile(r"\{[{%](.*?)[%}]\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def reads_variable(source: str, name: str) -> bool:
    """The template reads a top-level variable `name`: it appears in a `{{ }}`/`{% %}` tag
    outside string literals and not as an attribute (`message.thinking` is not `thinking`)."""
    word = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    return any(word.search(_STRING.sub("", tag.group(1))) for tag in _TAG.finditer(source))


@functools.lru_cache(maxsize=8)
def _switch(source: str) -> str | None:
    """The first of SWITCHES the template reads (None: it cannot switch thinking)."""
    return next((key for key in SWITCHES if reads_variable(source, key)), None)


def _effort(source: str, effort: str) -> tuple[dict, int | None]:
    on = effort not in ("none", "minimal")
    switch = _switch(source)
    if switch in ("enable_thinking", "thinking"):
        return {switch: on}, None
    if switch == "reasoning_effort":
        # NOTE: gpt-oss has no "off" level: "none" is its lowest level with no thinking room.
        return {switch: effort if effort in LEVELS else "low"}, 0 if effort == "none" else None
    return {}, None if on else 0


def _detect(tokenizer) -> str | None:
    added = tokenizer.get_added_vocab()
    if all(token in added for token in HARMONY_TOKENS):
        return GPT_OSS
    source = template_source(tokenizer)
    if not (all(token in added for token in THINK) or THINK[0] in source):
        return None
    if "<｜Assistant｜>" in added or "<｜Assistant｜>" in source:
        return "deepseek_r1"
    if "<|assistant|>" in added or "[gMASK]" in source:
        return "glm45"
    if "/no_think" in source:
        return "smollm3"
    return "qwen3"


def _ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _blank_ids(tokenizer) -> frozenset[int]:
    ids = {i for text in _BLANKS for i in tokenizer.encode(text, add_special_tokens=False)}
    return frozenset(i for i in ids if not tokenizer.decode([i]).strip())
