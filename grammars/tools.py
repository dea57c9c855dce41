"""Tool calls: the grammars that constrain them, in the model's own format (`ToolFormat`,
grammars/tool_formats.py, which describes each family's layout).

`tool_call_spec` (a forced call: `tool_choice` "required" or a named function) and
`auto_tool_spec` (`tool_choice` "auto") return Lark `GrammarSpec`s. With a marker the auto
grammar is free text that a call may follow, started by the marker token (free text never
holds a special token, so the marker is the trigger and text may start with any character);
without one the first character decides: `<tool_call>` starts the calls, any other text is free.

The shape of a call's rule follows the format:

* JSON object (Hermes, Llama 3.x, Mistral, kvserve): `call: %json {anyOf: [{name: const N,
  arguments: <parameters>}, ...]}`, one schema for all tools;
* name then JSON (DeepSeek, harmony): per tool `call_i: <call_open> "N" <name_close> args_i
  <call_close>`, `args_i: %json <parameters>`;
* name then XML parameters (Qwen3-Coder, GLM-4.5): per tool `args_i: p_i_0 p_i_1? ...`, one
  rule per declared property in schema order, required ones mandatory, others optional (so
  required parameters are enforced, none repeats and none outside `properties` is written).
  A string-typed value is free text that cannot hold the value's closing tag (a lazy lexeme
  ending at it; with a special-token close, any text), its `enum`/`const` honoured as literal
  choices, other string keywords (`maxLength`, `pattern`, `format`) not enforced; any other
  value is `%json` of the property's schema (with the parameters' `$defs`).

harmony (gpt-oss) writes one call per turn (its `<|call|>` ends the turn); the grammar stops after
the arguments, where the model's `<|call|>` end token follows. Its free text is the `final`
channel's message: `start: lead? (<|channel|> "final" <|message|> TEXT? | call)`, `lead` being
the `<|start|>assistant` a thinking block leaves before the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grammars.compile import GrammarError, GrammarSpec, _as_dict
from grammars.tool_formats import (  # noqa: F401  (re-exported: grammars.tools is where they were)
    KVSERVE_FORMAT,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Piece,
    ToolFormat,
    XmlParams,
    is_raw_string,
    output_format,
    value_end,
    tool_format,
)

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
    params = _parameters(fn)
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


def _strict(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _parameters(fn: Mapping[str, Any]) -> Mapping[str, Any]:
    params = fn.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, Mapping):
        raise GrammarError(f"tool {fn['name']!r}: parameters must be a JSON schema object", "tools")
    return params


def _regex_text(text: str) -> str:
    """`text` as a Lark /regex/ that matches it literally."""
    special = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "/": "\\/"}
    return "".join(special.get(c, re.escape(c)) for c in text)


def _xml_value_rules(rule: str, schema: Any, defs: Mapping[str, Any], close: Piece) -> list[str]:
    """Rules `rule` (a parameter's value and its closing piece) for an XML format."""
    if not is_raw_string(schema):
        schema = schema if isinstance(schema, Mapping) else {}
        value = json.dumps(_strict({**schema, **defs}), ensure_ascii=False)
        return [f"{rule}: {rule}_json {_lark_piece(close)}", f"{rule}_json: %json {value}"]
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values:
        return [f"{rule}: ({' | '.join(json.dumps(v) for v in values)}) {_lark_piece(close)}"]
    end = value_end(close)
    if isinstance(end, str):  # NOTE: a lazy lexeme: the value ends where its closing text first appears
        rest = (close[0][len(end):], *close[1:])
        return [f"{rule}: {rule}_text {_lark_piece(rest)}".rstrip(), f"{rule}_text[lazy]: /(.|\\n)*{_regex_text(end)}/"]
    return [f"{rule}: {rule.upper()}_TEXT? {_lark_piece(close)}", f"{rule.upper()}_TEXT: /(.|\\n)+/"]


def _named_call_rules(i: int, fn: Mapping[str, Any], fmt: ToolFormat) -> list[str]:
    """Rules `call_i` (one call of `fn`, wrappers included) for a format with the name outside
    the arguments."""
    params = _parameters(fn)
    name = f"{_lark_piece(fmt.call_open)} {json.dumps(fn['name'])} {_lark_piece(fmt.name_close)}"
    head = f"call_{i}: {name} args_{i} {_lark_piece(fmt.call_close)}"
    if fmt.params is None:
        return [head, f"args_{i}: %json {json.dumps(_strict(params), ensure_ascii=False)}"]
    properties = params.get("properties") or {}
    if not isinstance(properties, Mapping):
        raise GrammarError(f"tool {fn['name']!r}: parameters.properties must be an object", "tools")
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, items = [head], []
    for j, (key, schema) in enumerate(properties.items()):
        p = f"p_{i}_{j}"
        items.append(p if key in required else f"{p}?")
        rules.append(f"{p}: {_lark_piece(fmt.params.key_open)} {json.dumps(key)} {_lark_piece(fmt.params.key_close)} v_{i}_{j}")
        rules += _xml_value_rules(f"v_{i}_{j}", schema, defs, fmt.params.value_close)
    rules.append(f"args_{i}: {' '.join(items) or chr(34) * 2}")
    return rules


def _calls_grammar(functions: Sequence[Mapping[str, Any]], fmt: ToolFormat, parallel: bool) -> str:
    """Lark rules `calls` (one, or with `parallel` one or more, valid calls) and `call`."""
    parallel = parallel and fmt.parallel
    if fmt.name_close is None:
        schemas = [_call_schema(fn, fmt.arguments_key) for fn in functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        one = f"{_lark_piece(fmt.call_open)} call {_lark_piece(fmt.call_close)}".strip()
        rules = [f"call: %json {json.dumps(_strict(schema), ensure_ascii=False)}"]
    else:
        one = "call"
        rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, fn in enumerate(functions):
            rules += _named_call_rules(i, fn, fmt)
    more = f" ({_lark_piece(fmt.separator)} {one})*" if parallel else ""
    return f"calls: {_lark_piece(fmt.block_open)} {one}{more} {_lark_piece(fmt.block_close)}\n" + "\n".join(rules) + "\n"


def _start(fmt: ToolFormat, body: str) -> str:
    """The start rule: `body`, after the format's optional lead."""
    return f"start: ({_lark_piece(fmt.lead)})? ({body})\n" if fmt.lead else f"start: {body}\n"


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
    return GrammarSpec("lark", _start(fmt, "calls") + _calls_grammar(chosen, fmt, parallel), param="tools")


def auto_tool_spec(
    tools: Sequence[Mapping[str, Any]], *, parallel: bool = True, fmt: ToolFormat = KVSERVE_FORMAT,
) -> GrammarSpec:
    """`tool_choice: "auto"`: free text, or calls (one, or with `parallel` one or more).

    With a marker token in `fmt`: any free text, optionally followed by calls that the marker
    starts (llguidance never lets free text hold a special token, so the marker is the
    trigger). Without one: text that does not start with `<`, or calls from the first
    character on. Either way a call the model starts is always complete and valid. A format
    whose free text is a message of its own (harmony's final channel) gives that message or calls.
    """
    if fmt.text_open:
        start = _start(fmt, f"{_lark_piece(fmt.text_open)} TEXT? | calls") + "TEXT: /(.|\\n)+/\n"
    elif fmt.marker_ids:
        start = "start: TEXT | calls | TEXT calls | \"\"\nTEXT: /(.|\\n)+/\n"
    else:
        start = 'start: free | calls\nfree: /[^<][\\s\\S]*/ | ""\n'
    return GrammarSpec("lark", start + _calls_grammar(_functions(tools), fmt, parallel), param="tools")


def answer_spec(spec: GrammarSpec, fmt: ToolFormat | None) -> GrammarSpec:
    """`spec` (a response_format) as the model's answer: for a format whose answer is a message
    of its own (harmony's final channel) a JSON spec gets that message's header first, so the
    model writes `<|start|>assistant<|channel|>final<|message|>{...}` as it was trained to;
    any other spec, and any other format, is returned as it is."""
    if fmt is None or not fmt.text_open or spec.schema is None:
        return spec
    schema = {**spec.schema, "x-guidance": {"whitespace_flexible": bool(spec.whitespace_flexible)}}
    body = f"answer: %json {json.dumps(schema, ensure_ascii=False)}\n"
    return GrammarSpec("lark", _start(fmt, f"{_lark_piece(fmt.text_open)} answer") + body, param=spec.param)
