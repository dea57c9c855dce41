"""How a model writes tool calls: one `ToolFormat` per family, found from its tokenizer.

A format writes one turn's calls as

    lead? block_open CALL (separator CALL)* block_close

where each CALL takes one of three shapes:

* a JSON object (`name_close` None): call_open `{"name": N, "<arguments_key>": {...}}` call_close
  (Hermes / Qwen2.5, Llama 3.x, Mistral, and kvserve's own text format);
* a name, then JSON arguments: call_open N name_close `{...}` call_close (DeepSeek-V3/R1,
  gpt-oss harmony);
* a name, then XML parameters (`params`): call_open N name_close (key_open K key_close V
  value_close)* call_close (Qwen3-Coder, GLM-4.5). V is raw text for a string-typed parameter
  (`is_raw_string`) and JSON text for any other.

Pieces hold literal text and special-token ids (a model's own markers). `tool_format(tokenizer)`
finds the family from the tokenizer's added tokens (and, where two families share markers, its
chat template); a tokenizer without markers gets kvserve's own text wrappers (`KVSERVE_FORMAT`).
The grammars that constrain calls are in grammars/tools.py; the parser that reads them back is
server/api/tool_calls.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

Piece = tuple[str | int, ...]  # literal text and special-token ids, in order


@dataclass(frozen=True, slots=True)
class XmlParams:
    """How an XML format writes one parameter: key_open KEY key_close VALUE value_close."""

    key_open: Piece
    key_close: Piece
    value_close: Piece


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a turn's tool calls are written (see the module docstring).

    `lead` may start the output (harmony's `<|start|>assistant`, written again after a thinking
    block); `text_open` starts free text (harmony's final channel: free text is a message too);
    `markers` are further special tokens the parser must see (harmony's message ends);
    `parallel` False: a call ends the turn (harmony's `<|call|>` is an end token).
    """

    name: str
    block_open: Piece = ()
    call_open: Piece = ()
    call_close: Piece = ()
    separator: Piece = ()
    block_close: Piece = ()
    arguments_key: str = "arguments"
    name_close: Piece | None = None
    params: XmlParams | None = None
    lead: Piece = ()
    text_open: Piece = ()
    markers: Piece = ()
    parallel: bool = True

    @property
    def marker_ids(self) -> frozenset[int]:
        """The special tokens the format writes (empty: plain text only)."""
        pieces = [self.block_open, self.call_open, self.call_close, self.separator, self.block_close,
                  self.name_close or (), self.lead, self.text_open, self.markers]
        if self.params is not None:
            pieces += [self.params.key_open, self.params.key_close, self.params.value_close]
        return frozenset(part for piece in pieces for part in piece if isinstance(part, int))

    def render(self, calls: Sequence[tuple[str, Any]], token_text: Mapping[int, str]) -> str:
        """Calls (name, arguments object) as the model writes them, for a prompt; special
        tokens as `token_text` spells them. Arguments outside a call's JSON object are compact
        JSON, as the grammar writes them."""
        def text(piece: Piece) -> str:
            return "".join(p if isinstance(p, str) else token_text[p] for p in piece)

        def body(name: str, arguments: Any) -> str:
            if self.name_close is None:
                return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
            head = name + text(self.name_close)
            if self.params is None or not isinstance(arguments, Mapping):
                return head + _compact(arguments)
            p = self.params
            return head + "".join(
                text(p.key_open) + key + text(p.key_close)
                + (value if isinstance(value, str) else _compact(value)) + text(p.value_close)
                for key, value in arguments.items()
            )

        bodies = [text(self.call_open) + body(name, arguments) + text(self.call_close) for name, arguments in calls]
        return text(self.block_open) + text(self.separator).join(bodies) + text(self.block_close)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def is_raw_string(schema: Any) -> bool:
    """Whether an XML format writes a parameter of this schema as raw text (a string: `type`
    "string", or only string `enum`/`const` values), else as JSON text."""
    if not isinstance(schema, Mapping):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return schema.get("type") is None and bool(values) and all(isinstance(v, str) for v in values)


def value_end(close: Piece) -> str | int:
    """Where an XML parameter's value ends, for the grammar and the parser alike: at the
    closing piece's first part, a special token, or text up to its trailing whitespace (Qwen3-
    Coder's value ends at the first `\\n</parameter>`, the `\\n` after it follows)."""
    first = close[0]
    if isinstance(first, int):
        return first
    if not first.rstrip():
        raise ValueError(f"a value's closing piece must start with a marker or text: {close!r}")
    return first.rstrip()


# kvserve's own format for tokenizers without a marker: calls wrapped in `<tool_call>` text, one
# per line (under "auto" the first character decides, so text may not start with `<`).
KVSERVE_FORMAT = ToolFormat("kvserve", call_open=(TOOL_CALL_OPEN,), call_close=(TOOL_CALL_CLOSE,), separator=("\n",))


def _has(ids: Mapping[str, int], *markers: str) -> bool:
    return all(m in ids for m in markers)


def _harmony(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if not _has(ids, "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"):
        return None
    start, channel, message, constrain = (ids[m] for m in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"))
    ends = tuple(ids[m] for m in ("<|end|>", "<|return|>", "<|call|>") if m in ids)
    return ToolFormat(
        "harmony", lead=(start, "assistant"), call_open=(channel, "commentary to=functions."),
        name_close=(" ", constrain, "json", message), text_open=(channel, "final", message), markers=ends, parallel=False,
    )


_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def _deepseek(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if not _has(ids, *_DS):
        return None
    calls_begin, call_begin, sep, call_end, calls_end = (ids[m] for m in _DS)
    return ToolFormat(
        "deepseek", block_open=(calls_begin,), call_open=(call_begin, "function", sep), name_close=("\n```json\n",),
        call_close=("\n```", call_end), separator=("\n",), block_close=(calls_end,),
    )


def _glm45(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if not _has(ids, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"):
        return None
    params = XmlParams((ids["<arg_key>"],), (ids["</arg_key>"], "\n", ids["<arg_value>"]), (ids["</arg_value>"], "\n"))
    return ToolFormat("glm45", call_open=(ids[TOOL_CALL_OPEN],), name_close=("\n",), params=params,
                      call_close=(ids[TOOL_CALL_CLOSE],), separator=("\n",))


def _qwen3_coder(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if not _has(ids, TOOL_CALL_OPEN, TOOL_CALL_CLOSE) or "<function=" not in template:
        return None
    params = XmlParams(("<parameter=",), (">\n",), ("\n</parameter>\n",))
    return ToolFormat("qwen3_coder", call_open=(ids[TOOL_CALL_OPEN], "\n<function="), name_close=(">\n",), params=params,
                      call_close=("</function>\n", ids[TOOL_CALL_CLOSE]), separator=("\n",))


def _hermes(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if not _has(ids, TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        return None
    return ToolFormat("hermes", call_open=(ids[TOOL_CALL_OPEN], "\n"), call_close=("\n", ids[TOOL_CALL_CLOSE]), separator=("\n",))


def _llama3(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if "<|python_tag|>" not in ids:
        return None
    return ToolFormat("llama3", block_open=(ids["<|python_tag|>"],), separator=("; ",), arguments_key="parameters")


def _mistral(ids: Mapping[str, int], template: str) -> ToolFormat | None:
    if "[TOOL_CALLS]" not in ids:
        return None
    return ToolFormat("mistral", block_open=(ids["[TOOL_CALLS]"], "["), separator=(", ",), block_close=("]",))


# NOTE: order matters: GLM-4.5 and Qwen3-Coder carry Hermes' `<tool_call>` markers too.
_MARKER_FORMATS = (_harmony, _deepseek, _glm45, _qwen3_coder, _hermes, _llama3, _mistral)


@functools.lru_cache(maxsize=8)
def tool_format(tokenizer) -> ToolFormat | None:
    """The format named by the tokenizer's tool-call marker tokens (added tokens), or None
    when it has none (then kvserve's own text wrappers apply). First match wins:

    * harmony (gpt-oss): `<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>`;
    * DeepSeek-V3/R1 (the R1 / V3-0324 layout: `function<｜tool▁sep｜>NAME` and a fenced JSON
      block, not V3.1's): its five `<｜tool▁...｜>` markers;
    * GLM-4.5: `<tool_call>`, `</tool_call>` and the `<arg_key>`/`<arg_value>` pairs;
    * Qwen3-Coder: `<tool_call>` + `</tool_call>` and a chat template that writes `<function=`;
    * Hermes / Qwen2.5 / Qwen3: `<tool_call>` + `</tool_call>`;
    * Llama 3.x: `<|python_tag|>`; Mistral: `[TOOL_CALLS]`.
    """
    added = tokenizer.get_added_vocab()
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else json.dumps(template or "")
    for detect in _MARKER_FORMATS:
        if (fmt := detect(added, template)) is not None:
            return fmt
    return None


def output_format(model_format: ToolFormat | None) -> ToolFormat:
    """The format calls are written in: the model's own, else kvserve's."""
    return KVSERVE_FORMAT if model_format is None else model_format
