"""Generated tool calls -> OpenAI's `tool_calls`, as a whole or streamed.

The grammar (grammars/tools.py) guarantees the shape of the output, so parsing is a small
state machine over its text: free text (content) until the format's block starts, then for
each call its name (one event with a fresh id and index) and its arguments as they are
generated (events carrying the new argument text), skipping the pieces between calls. A call
cut short (max_tokens) keeps the arguments generated so far; a call whose name is incomplete,
and any part of the format's wrappers, never reach the client.

Special tokens (a model's markers) are not in the engine's text (it skips special tokens), so
with a marker format the parser decodes the token ids itself and writes each marker as a
private sentinel that free text cannot be confused with.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from grammars import ToolFormat, output_format, tool_format
from server.engine.detokenizer import TextStream
from server.engine.sequence import RequestOutput


def _sentinel(token_id: int) -> str:
    return f"\U000f0000{token_id}\U000f0001"


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


class ToolCallParser:
    """One choice's output -> content and calls. `feed` each RequestOutput (streaming or
    not), then `finish(finish_reason)`; `calls` and `content` hold the results so far."""

    def __init__(self, fmt: ToolFormat, *, at_start: bool, tokenizer=None) -> None:
        self._start = _piece_text(fmt.block_open + fmt.call_open)
        self._at_start = at_start  # the calls can only begin the output (no marker)
        self._head = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + re.escape(fmt.arguments_key) + r'"\s*:\s*')
        self._decoder = _MarkerText(tokenizer, fmt.marker_ids) if fmt.marker_ids else None
        self._state = "content"
        self._buf = ""
        self._depth, self._in_string, self._escaped = 0, False, False
        self.content = ""
        self.calls: list[Call] = []

    def feed(self, output: RequestOutput) -> Events:
        if self._decoder is None:
            text = output.text
        else:
            text = self._decoder.push(t.token_id for t in output.tokens)
            if output.finished:
                text += self._decoder.flush()
        self._buf += text
        events = Events()
        while self._step(events):
            pass
        return events

    def finish(self, finish_reason: str) -> tuple[Events, str]:
        """The last events (held-back content) and the finish reason: "tool_calls" for calls
        that completed, else the engine's (a cut-off call keeps "length")."""
        events = Events()
        if self._state in ("content", "text") and self._buf:
            # a held-back start of the wrappers: content only if the output really ended there
            if finish_reason == "stop" or not self._start.startswith(self._buf):
                self._add_content(events, self._buf)
            self._buf = ""
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return events, finish_reason

    # ------------------------------------------------------------------ states

    def _add_content(self, events: Events, text: str) -> None:
        events.content += text
        self.content += text

    def _step(self, events: Events) -> bool:
        """Consume what the current state can; True when the state changed (run again)."""
        return getattr(self, "_in_" + self._state)(events)

    def _in_content(self, events: Events) -> bool:
        buf, start = self._buf, self._start
        if self._at_start:
            if buf.startswith(start):
                self._buf, self._state = buf[len(start):], "between"
                return True
            if start.startswith(buf):
                return False  # not decided yet
            self._state = "text"
            return True
        i = buf.find(start)
        if i >= 0:
            self._add_content(events, buf[:i])
            self._buf, self._state = buf[i + len(start):], "between"
            return True
        keep = next((n for n in range(min(len(start) - 1, len(buf)), 0, -1) if buf.endswith(start[:n])), 0)
        self._add_content(events, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _in_text(self, events: Events) -> bool:
        self._add_content(events, self._buf)
        self._buf = ""
        return False

    def _in_between(self, events: Events) -> bool:
        i = self._buf.find("{")
        if i < 0:
            self._buf = ""
            return False
        self._buf, self._state = self._buf[i:], "head"
        return True

    def _in_head(self, events: Events) -> bool:
        m = self._head.match(self._buf)
        if m is None:
            return False
        call = Call(len(self.calls), new_call_id(), json.loads(m.group(1)))
        self.calls.append(call)
        events.started.append(call)
        self._buf, self._state = self._buf[m.end():], "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False
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
        if taken:
            call = self.calls[-1]
            call.arguments += taken
            events.arguments[call.index] = events.arguments.get(call.index, "") + taken
        if end is None:
            self._buf = ""
            return False
        self._buf, self._state = self._buf[end:], "between"
        return True


def tool_parser(tokenizer, tool_mode: str | None) -> ToolCallParser | None:
    """The parser for a request's tool mode ("forced", "auto" or None: no parsing), in the
    tokenizer's tool format (no tokenizer: kvserve's own, read from the text)."""
    if tool_mode is None:
        return None
    model_format = tool_format(tokenizer) if tokenizer is not None else None
    return ToolCallParser(output_format(model_format), at_start=model_format is None, tokenizer=tokenizer)
