"""Generated tool calls -> OpenAI's `tool_calls`, as a whole or streamed.

The grammar (grammars/tools.py) guarantees the shape of the output, so parsing is a small
state machine over its text, in the model's format (grammars/tool_formats.py): free text
(content) until the format's block starts, then for each call its name (one event with a fresh
id and index) and its arguments as they are generated (events carrying the new argument text;
an XML format's parameters arrive as a JSON object text, `{"city": "Par` then `is"}`), skipping
the pieces between calls. harmony's output is messages: the final channel is content, a
`commentary to=functions.N` message a call. A call is `complete` once its closing piece is
seen; one cut short (max_tokens) keeps the arguments generated so far, none when the cut came
after its name and before its arguments; a call whose name is incomplete, and any part of the
format's wrappers, never reach the client. A call that repeats
an earlier one (small models loop on one call) ends the turn's calls (`ended`), unsent.

Special tokens (a model's markers) are not in the engine's text (it skips special tokens), so
with a marker format the parser decodes the token ids itself and writes each marker as a
private sentinel that free text cannot be confused with.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from grammars import ToolFormat, is_raw_string, output_format, value_end
from server.engine.detokenizer import TextStream
from server.engine.sequence import RequestOutput


def _sentinel(token_id: int) -> str:
    return f"\U000f0000{token_id}\U000f0001"


_SENTINEL = re.compile("\U000f0000(\\d+)\U000f0001")


def _piece_text(piece) -> str:
    return "".join(p if isinstance(p, str) else _sentinel(p) for p in piece)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False  # its closing piece was seen (else cut off: the arguments so far)

    def wire(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Events:
    """What one chunk of output added: content text, calls begun, argument text per call."""

    content: str = ""
    started: list[Call] = field(default_factory=list)
    arguments: dict[int, str] = field(default_factory=dict)  # call index -> new argument text


class _MarkerText:
    """Token ids -> text, markers written as sentinels (the engine's text skips them)."""

    def __init__(self, tokenizer, marker_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._markers = marker_ids
        self._stream = TextStream(tokenizer)

    def push(self, token_ids) -> str:
        out = ""
        for token_id in token_ids:
            if token_id in self._markers:
                out += self._stream.flush() + _sentinel(token_id)
                self._stream = TextStream(self._tokenizer)
            else:
                out += self._stream.push(token_id).text
        return out

    def flush(self) -> str:
        return self._stream.flush()


def _partial(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that may be the start of `marker` (held back)."""
    return next((n for n in range(min(len(marker) - 1, len(buf)), 0, -1) if buf.endswith(marker[:n])), 0)


def _same(a: Call, b: Call) -> bool:
    """The same call: name and arguments (compared as JSON when both parse, else as text)."""
    if a.name != b.name:
        return False
    try:
        return json.loads(a.arguments) == json.loads(b.arguments)
    except ValueError:
        return a.arguments == b.arguments


def _json_text(value: str) -> str:
    """An XML value of unknown type as JSON text: as written if it parses, else a string."""
    try:
        json.loads(value)
        return value.strip()
    except ValueError:
        return json.dumps(value, ensure_ascii=False)


def _string_parameters(tools) -> dict[str, dict[str, bool]]:
    """The request's tools -> name -> parameter -> written as raw text (grammars.is_raw_string)."""
    strings: dict[str, dict[str, bool]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
        properties = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
        strings[fn["name"]] = {key: is_raw_string(schema) for key, schema in properties.items()}
    return strings


class ToolCallParser:
    """One choice's output -> content and calls. `feed` each RequestOutput (streaming or
    not), then `finish(finish_reason)`; `calls` and `content` hold the results so far.

    States (markers written as sentinels): content -> name -> arguments (JSON) or params /
    key / value (XML, converted to a JSON object text as it comes) -> tail -> between -> name
    ... A harmony output is a run of messages instead (`channels`): the final channel's text is
    content, a `commentary to=functions.N` message is a call, other channels are dropped.

    `ended` turns True when a call repeats an earlier one (same name and arguments): the turn's
    calls end there, the repeat and all after it dropped (the server may stop generating), and
    `finish` says "tool_calls". A call named like an earlier one is held back (no events) until
    its arguments are complete and differ, then released whole, so a repeat never reaches a
    client.
    """

    def __init__(self, fmt: ToolFormat, *, at_start: bool, tokenizer=None, tools=None) -> None:
        self._start = _piece_text(fmt.block_open + fmt.call_open)
        self._at_start = at_start  # the calls can only begin the output (no marker)
        self._call_open = _piece_text(fmt.call_open)
        self._name_close = None if fmt.name_close is None else _piece_text(fmt.name_close)
        self._tail = ("}" if fmt.name_close is None else "") + _piece_text(fmt.call_close)
        self._xml: tuple[str, str, str] | None = None  # key_open, key_close, where a value ends
        if fmt.params is not None:
            end = value_end(fmt.params.value_close)
            self._xml = (_piece_text(fmt.params.key_open), _piece_text(fmt.params.key_close),
                         end if isinstance(end, str) else _sentinel(end))
        self._strings = _string_parameters(tools)
        named = r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'
        self._named = re.compile(named)  # a head cut after its name
        self._head = re.compile(named + r'\s*,\s*"' + re.escape(fmt.arguments_key) + r'"\s*:\s*')
        self._decoder = _MarkerText(tokenizer, fmt.marker_ids) if fmt.marker_ids else None
        harmony = bool(fmt.text_open)
        self._state = "channels" if harmony else "content"
        self._after_call = "channels" if harmony else "between"
        # harmony: the channel and message markers; the header of the message being read (None
        # inside a body), where its channel name starts, and whether the body is content
        self._channel, self._message = (fmt.text_open[0], fmt.text_open[-1]) if harmony else (None, None)
        # NOTE: text before any header is the answer: a grammar may write it straight after the
        # thinking's `<|end|>` (a JSON answer without its final channel header)
        self._header: str | None = None
        self._channel_at = 0
        self._visible = True
        self._buf = ""
        self._depth, self._in_string, self._escaped = 0, False, False
        self._call: Call | None = None  # the call being read
        self._held = False  # ... named like an earlier call: no events until it is known to differ
        self._raw: bool | None = None  # the XML value being read is a string (None: unknown, buffered)
        self._value = ""
        self.content = ""
        self.calls: list[Call] = []
        self.ended = False

    def feed(self, output: RequestOutput) -> Events:
        events = Events()
        if self.ended:
            return events
        if self._decoder is None:
            text = output.text
        else:
            text = self._decoder.push(t.token_id for t in output.tokens)
            if output.finished:
                text += self._decoder.flush()
        self._buf += text
        while self._step(events):
            pass
        return events

    def finish(self, finish_reason: str) -> tuple[Events, str]:
        """The last events (held-back content, a held-back call cut short) and the finish
        reason: "tool_calls" for calls that completed or a turn a repeated call `ended`, else
        the engine's (a cut-off call keeps "length")."""
        events = Events()
        if self._state in ("content", "text") and self._buf:
            # a held-back start of the wrappers: content only if the output really ended there
            if finish_reason == "stop" or not self._start.startswith(self._buf):
                self._add_content(events, self._buf)
            self._buf = ""
        if self._state == "tail" and finish_reason == "stop":
            self._close(events)
        if self._state == "name" and self._name_close is None:  # cut after a whole name, before its arguments
            i = self._buf.find("{")
            named = self._named.match(self._buf, i) if i >= 0 else None
            if named is not None:
                self._begin(events, json.loads(named.group(1)))
        if self._call is not None:  # cut off inside a call: it keeps its arguments so far
            if self._state == "value" and self._raw is None:
                self._extend(events, json.dumps(self._value, ensure_ascii=False)[:-1])
            call, self._call = self._call, None
            if self._held and any(c.name == call.name and c.arguments.startswith(call.arguments) for c in self.calls):
                self._end()  # on its way to repeating an earlier call
            elif self._held:
                self._release(events, call)
        if self.ended:
            return events, "tool_calls"
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return events, finish_reason

    # ------------------------------------------------------------------ calls

    def _add_content(self, events: Events, text: str) -> None:
        events.content += text
        self.content += text

    def _begin(self, events: Events, name: str) -> None:
        self._call = Call(len(self.calls), new_call_id(), name)
        self._held = any(c.name == name for c in self.calls)
        self._depth, self._in_string, self._escaped = 0, False, False
        if not self._held:
            self.calls.append(self._call)
            events.started.append(self._call)

    def _extend(self, events: Events, text: str) -> None:
        call = self._call
        call.arguments += text
        if text and not self._held:
            events.arguments[call.index] = events.arguments.get(call.index, "") + text

    def _release(self, events: Events, call: Call) -> None:
        call.index = len(self.calls)
        self.calls.append(call)
        events.started.append(call)
        if call.arguments:
            events.arguments[call.index] = call.arguments

    def _close(self, events: Events) -> None:
        """The call's closing piece was seen: it is complete; a held call is released, or, when
        it repeats an earlier one, ends the turn's calls."""
        call, self._call = self._call, None
        call.complete = True
        if self._held:
            if any(_same(c, call) for c in self.calls):
                self._end()
                return
            self._release(events, call)

    def _end(self) -> None:
        self.ended = True
        self._state, self._buf, self._call = "ended", "", None

    # ------------------------------------------------------------------ states

    def _step(self, events: Events) -> bool:
        """Consume what the current state can; True when the state changed (run again)."""
        return getattr(self, "_in_" + self._state)(events)

    def _in_content(self, events: Events) -> bool:
        buf, start = self._buf, self._start
        if self._at_start:
            if buf.startswith(start):
                self._buf, self._state = buf[len(start):], "name"
                return True
            if start.startswith(buf):
                return False  # not decided yet
            self._state = "text"
            return True
        i = buf.find(start)
        if i >= 0:
            self._add_content(events, buf[:i])
            self._buf, self._state = buf[i + len(start):], "name"
            return True
        keep = _partial(buf, start)
        self._add_content(events, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _in_text(self, events: Events) -> bool:
        self._add_content(events, self._buf)
        self._buf = ""
        return False

    def _in_ended(self, events: Events) -> bool:
        self._buf = ""
        return False

    def _in_channels(self, events: Events) -> bool:
        """harmony: messages `<|channel|>HEADER<|message|>BODY`, each body ending at a marker
        (`<|end|>`, `<|return|>`, `<|call|>`, `<|start|>` or the next `<|channel|>`)."""
        m = _SENTINEL.search(self._buf)
        text, self._buf = (self._buf, "") if m is None else (self._buf[: m.start()], self._buf[m.end():])
        if self._header is not None:
            self._header += text
        elif self._visible:
            self._add_content(events, text)
        if m is None:
            return False
        token = int(m.group(1))
        if self._header is None:  # a body ends at any marker
            if token == self._message:
                return True
            self._header, self._visible = "", False
        if token == self._channel:
            self._channel_at = len(self._header)
        elif token == self._message:
            header, self._header = self._header, None
            recipient = re.search(r"to=functions\.(\S+)", header)
            if recipient:
                self._begin(events, recipient.group(1))
                self._state = "arguments"
            else:
                self._visible = header[self._channel_at:].split()[:1] == ["final"]
        else:
            self._header += " "  # <|constrain|>, <|start|>, an end marker
        return True

    def _in_between(self, events: Events) -> bool:
        if not self._call_open:  # JSON objects one after another (Llama 3.x, Mistral)
            self._state = "name"
            return True
        i = self._buf.find(self._call_open)
        if i < 0:
            self._buf = self._buf[len(self._buf) - _partial(self._buf, self._call_open):]
            return False
        self._buf, self._state = self._buf[i + len(self._call_open):], "name"
        return True

    def _in_name(self, events: Events) -> bool:
        """The call's name; a call whose name never completes is never started."""
        if self._name_close is None:
            i = self._buf.find("{")
            if i < 0:
                self._buf = ""
                return False
            m = self._head.match(self._buf, i)
            if m is None:
                self._buf = self._buf[i:]
                return False
            name, self._buf = json.loads(m.group(1)), self._buf[m.end():]
        else:
            i = self._buf.find(self._name_close)
            if i < 0:
                return False
            name, self._buf = self._buf[:i].strip(), self._buf[i + len(self._name_close):]
        self._begin(events, name)
        self._state = "arguments" if self._xml is None else "params"
        return True

    def _in_arguments(self, events: Events) -> bool:
        """Scan the arguments value: it ends where its object closes (or, for a scalar, at the
        call's own closing brace)."""
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        taken = self._buf if end is None else self._buf[:end]
        self._extend(events, taken)
        if end is None:
            self._buf = ""
            return False
        self._buf, self._state = self._buf[end:], "tail"
        return True

    def _in_tail(self, events: Events) -> bool:
        """What follows the arguments, to the call's closing piece."""
        i = self._buf.find(self._tail)
        if i < 0:
            return False
        self._buf = self._buf[i + len(self._tail):]
        self._close(events)
        if not self.ended:
            self._state = self._after_call
        return True

    def _in_params(self, events: Events) -> bool:
        """XML: the next parameter, or the call's closing piece."""
        key_open = self._xml[0]
        k, c = self._buf.find(key_open), self._buf.find(self._tail)
        if k >= 0 and (c < 0 or k < c):
            self._buf, self._state = self._buf[k + len(key_open):], "key"
            return True
        if c >= 0:
            self._extend(events, "}" if self._call.arguments else "{}")
            self._state = "tail"
            return True
        return False

    def _in_key(self, events: Events) -> bool:
        i = self._buf.find(self._xml[1])
        if i < 0:
            return False
        key, self._buf = self._buf[:i].strip(), self._buf[i + len(self._xml[1]):]
        self._raw = self._strings.get(self._call.name, {}).get(key)
        lead = ", " if self._call.arguments else "{"
        self._extend(events, lead + json.dumps(key, ensure_ascii=False) + ": " + ('"' if self._raw else ""))
        self._state, self._value = "value", ""
        return True

    def _in_value(self, events: Events) -> bool:
        """XML: a value, streamed as JSON text: a string's text escaped as it comes, any other
        value's JSON text as written (an unknown parameter's value is read whole, then JSON
        text if it parses, else a string)."""
        end = self._xml[2]
        i = self._buf.find(end)
        cut = i if i >= 0 else len(self._buf) - _partial(self._buf, end)
        text, self._buf = self._buf[:cut], self._buf[cut + len(end) if i >= 0 else cut:]
        if self._raw is None:
            self._value += text
        elif self._raw:
            self._extend(events, json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._extend(events, text)
        if i < 0:
            return False
        if self._raw is None:
            self._extend(events, _json_text(self._value))
        elif self._raw:
            self._extend(events, '"')
        self._state = "params"
        return True


def tool_parser(model_format: ToolFormat | None, tokenizer, tool_mode: str | None, tools=None) -> ToolCallParser | None:
    """The parser for a request's tool mode ("forced", "auto" or None: no parsing), in the
    model's own tool format (`Dialect.tools`; None: kvserve's own, read from the text).
    `tools` (the request's) tell an XML format's string parameters from others."""
    if tool_mode is None:
        return None
    return ToolCallParser(output_format(model_format), at_start=model_format is None, tokenizer=tokenizer, tools=tools)
