"""Structured output with llguidance: an engine-level part and a per-request part.

Engine level (`compile.py`): `spec_from_request` turns request fields into a `GrammarSpec`
(`tools.py`: `tool_call_spec` / `auto_tool_spec` for tool calls, written in the model's
`tool_format`, one per model family: `tool_formats.py`); one `GrammarCompiler` per loaded
model compiles specs into shared `CompiledGrammar`s (LRU, time limit, `GrammarError` for
anything a client got wrong).

Per request (`matcher.py`): `compiled.new_matcher()` gives each sequence its own `Matcher`.
One decode step, as the engine drives it::

    m = compiled.new_matcher()
    ff = m.fast_forward_tokens(); m.accept_tokens(ff)    # forced prefix, e.g. '{"name'
    feed = prompt_ids + ff
    while not m.is_terminated:
        m.start_mask()                      # computed in a worker during the forward pass
        logits = forward(feed)              # [vocab_size] at the last position, one pass
        m.apply_mask(logits)                # disallowed -> -inf; EOS only once accepting
        tok = sample(logits)
        if not m.accept(tok): return fail(m.error)   # never end an errored matcher as "stop"
        ff = [] if m.is_terminated else m.fast_forward_tokens()
        m.accept_tokens(ff); feed = [tok, *ff]        # emit feed (minus EOS) to the client
    finish("stop")                          # complete grammar: no extra forward pass
"""

from grammars.compile import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec, spec_from_request
from grammars.matcher import Matcher
from grammars.tool_formats import (
    KVSERVE_FORMAT,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolFormat,
    XmlParams,
    is_raw_string,
    output_format,
    tool_format,
    value_end,
)
from grammars.tools import answer_spec, auto_tool_spec, tool_call_spec

__all__ = [
    "KVSERVE_FORMAT",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "auto_tool_spec",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "Matcher",
    "spec_from_request",
    "ToolFormat",
    "XmlParams",
    "is_raw_string",
    "output_format",
    "tool_call_spec",
    "answer_spec",
    "tool_format",
    "value_end",
]
