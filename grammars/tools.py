"""Tool calls: how a model writes them (`ToolFormat`) and the grammars that constrain them.

A format writes one turn's calls as

    block_open call_open CALL call_close (separator call_open CALL call_close)* block_close

where CALL is `{"name": N, "<arguments_key>": {...}}` in compact JSON and each piece holds
literal text and special-token ids (a model's own markers). `tool_format(tokenizer)` finds the
format a tokenizer's marker tokens name (Hermes / Qwen2.5 `<tool_call>`, Llama 3.x
`<|python_tag|>`, Mistral `[TOOL_CALLS]`); a tokenizer without one gets kvserve's own text
wrappers (`KVSERVE_FORMAT`: `<tool_call>{...}</tool_call>`, one call per line).

`tool_call_spec` (a forced call: `tool_choice` "required" or a named function) and
`auto_tool_spec` (`tool_choice` "auto") return Lark `GrammarSpec`s. With a marker the auto
grammar is free text that a call may follow, started by the marker token (free text never
holds a special token, so the marker is the trigger and text may start with any character);
without one the first character decides: `<tool_call>` starts the calls, any other text is free.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grammars.compile import GrammarError, GrammarSpec, _as_dict

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

Piece = tuple[str | int, ...]  # literal text and special-token ids, in order


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a turn's tool calls are written (see the module docstring)."""

    name: str
    block_open: Piece = ()
    call_open: Piece = ()
    call_close: Piece = ()
    separator: Piece = ()
    block_close: Piece = ()
    arguments_key: str = "arguments"

    @property
    def marker_ids(self) -> frozenset[int]:
        """The special tokens the format writes (empty: plain text only)."""
        pieces = (self.block_open, self.call_open, self.call_close, self.separator, self.block_close)
        return frozenset(part for piece in pieces for part in piece if isinstance(part, int))

    def render(self, calls: Sequence[tuple[str, Any]], token_text: Mapping[int, str]) -> str:
        """Calls (name, arguments object) as the model writes them, for a prompt; special
        tokens as `token_text` spells them."""
        def text(piece: Piece) -> str:
            return "".join(p if isinstance(p, str) else token_text[p] for p in piece)

        bodies = [
            text(self.call_open)
            + json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
            + text(self.call_close)
            for name, arguments in calls
        ]
        return text(self.block_open) + text(self.separator).join(bodies) + text(self.block_close)


# kvserve's own format for tokenizers without a marker: calls wrapped in `<tool_call>` text, one
# per line (under "auto" the first character decides, so text may not start with `<`).
KVSERVE_FORMAT = ToolFormat("kvserve", call_open=(TOOL_CALL_OPEN,), call_close=(TOOL_CALL_CLOSE,), separator=("\n",))


def _hermes(ids: Mapping[str, int]) -> ToolFormat | None:
    if TOOL_CALL_OPEN not in ids or TOOL_CALL_CLOSE not in ids:
        return None
    return ToolFormat("hermes", call_open=(ids[TOOL_CALL_OPEN], "\n"), call_close=("\n", ids[TOOL_CALL_CLOSE]), separator=("\n",))


def _llama3(ids: Mapping[str, int]) -> ToolFormat | None:
    if "<|python_tag|>" not in ids:
        return None
    return ToolFormat("llama3", block_open=(ids["<|python_tag|>"],), separator=("; ",), arguments_key="parameters")


def _mistral(ids: Mapping[str, int]) -> ToolFormat | None:
    if "[TOOL_CALLS]" not in ids:
        return None
    return ToolFormat("mistral", block_open=(ids["[TOOL_CALLS]"], "["), separator=(", ",), block_close=("]",))


_MARKER_FORMATS = (_hermes, _llama3, _mistral)


@functools.lru_cache(maxsize=8)
def tool_format(tokenizer) -> ToolFormat | None:
    """The format named by the tokenizer's tool-call marker tokens (added tokens), or None
    when it has none (then kvserve's own text wrappers apply). First match wins:
    `<tool_call>` + `</tool_call>` (Hermes, Qwen2.5), `<|python_tag|>` (Llama 3.x),
    `[TOOL_CALLS]` (Mistral)."""
    added = tokenizer.get_added_vocab()
    for detect in _MARKER_FORMATS:
        if (fmt := detect(added)) is not None:
            return fmt
    return None


def output_format(model_format: ToolFormat | None) -> ToolFormat:
    """The format calls are written in: the model's own, else kvserve's."""
    return KVSERVE_FORMAT if model_format is None else model_format


# ---------------------------------------------------------------- request fields -> spec


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    functions = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise GrammarError("each tool needs function.name", "tools")
        functions.append(fn)
    return functions


def _call_schema(fn: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, Mapping):
        raise GrammarError(f"tool {fn['name']!r}: parameters must be a JSON schema object", "tools")
    # NOTE: the $id keeps each tool's local `#/$defs/...` references resolvable in the union.
    arguments = {"$id": f"urn:kvserve:tool:{fn['name']}", **params}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _lark_piece(piece: Piece) -> str:
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p) for p in piece if p != "")


def _calls_grammar(functions: Sequence[Mapping[str, Any]], fmt: ToolFormat, parallel: bool) -> str:
    """Lark rules `calls` (one, or with `parallel` one or more, valid calls) and `call`."""
    schemas = [_call_schema(fn, fmt.arguments_key) for fn in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    one = f"{_lark_piece(fmt.call_open)} call {_lark_piece(fmt.call_close)}".strip()
    more = f" ({_lark_piece(fmt.separator)} {one})*" if parallel else ""
    return (
        f"calls: {_lark_piece(fmt.block_open)} {one}{more} {_lark_piece(fmt.block_close)}\n"
        f"call: %json {json.dumps(schema, ensure_ascii=False)}\n"
    )


def tool_call_spec(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel: bool = True,
    fmt: ToolFormat = KVSERVE_FORMAT,
) -> GrammarSpec | None:
    """A forced call: the output is one call (`parallel` false or a named function) or one or
    more calls (`tool_choice` "required" with `parallel`), written in `fmt` from the first
    token on (the wrapper's start and a single tool's name are fast-forwarded).

    "required" allows any of `tools`; `{"type": "function", "function": {"name": N}}` only N
    (always one call, as OpenAI). "auto" and "none" return None (see `auto_tool_spec`).
    """
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        chosen = functions
    else:
        fn = _as_dict(tool_choice, "tool_choice").get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        chosen = [fn for fn in functions if fn["name"] == name]
        if not chosen:
            raise GrammarError(f"tool_choice names no function in tools: {name!r}", "tool_choice")
        parallel = False
    if not chosen:
        raise GrammarError("tool_choice 'required' needs at least one tool", "tool_choice")
    return GrammarSpec("lark", "start: calls\n" + _calls_grammar(chosen, fmt, parallel), param="tools")


def auto_tool_spec(
    tools: Sequence[Mapping[str, Any]], *, parallel: bool = True, fmt: ToolFormat = KVSERVE_FORMAT,
) -> GrammarSpec:
    """`tool_choice: "auto"`: free text, or calls (one, or with `parallel` one or more).

    With a marker token in `fmt`: any free text, optionally followed by calls that the marker
    starts (llguidance never lets free text hold a special token, so the marker is the
    trigger). Without one: text that does not start with `<`, or calls from the first
    character on. Either way a call the model starts is always complete and valid.
    """
    if fmt.marker_ids:
        start = "start: TEXT | calls | TEXT calls | \"\"\nTEXT: /(.|\\n)+/\n"
    else:
        start = 'start: free | calls\nfree: /[^<][\\s\\S]*/ | ""\n'
    return GrammarSpec("lark", start + _calls_grammar(_functions(tools), fmt, parallel), param="tools")
