"""One choice's output assembled once, for both APIs: reasoning, answer text, tool calls.

The engine hands a choice's outputs with a thinking model's reasoning already apart
(`RequestOutput.reasoning`, and the first `n_reasoning` of its tokens: server/engine/reasoning.py).
The answer goes through the tool-call parser (server/api/tool_calls.py) when the request offers
tools, or when the model's own format needs one to find its answer (gpt-oss's harmony channels).
Chat Completions renders an `Assembly` as a message and as chunk deltas; the Responses API as
output items and events. So the reasoning, the calls and the finish reason are decided here
and only here, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.api.dialect import Dialect
from server.api.tool_calls import Call, tool_parser
from server.engine.sequence import RequestOutput


@dataclass(slots=True)
class Parts:
    """What one engine output added: reasoning text, answer text, calls begun, argument text
    per call index."""

    reasoning: str = ""
    content: str = ""
    started: list[Call] = field(default_factory=list)
    arguments: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.started or self.arguments)


class Assembly:
    """One choice: `feed` each engine output (streaming or not), then `finish`; `reasoning`,
    `content`, `calls` and `finish_reason` hold the result. `thinking`: the request runs the
    model's reasoning parser (without one, reasoning fields are never rendered: a model
    without markers answers exactly as before)."""

    def __init__(self, dialect: Dialect, tokenizer, tool_mode: str | None, *, thinking: bool = False, tools=None) -> None:
        mode = tool_mode or ("auto" if dialect.channels else None)  # the answer is the final channel
        self._parser = tool_parser(dialect.tools, tokenizer, mode, tools)
        self.thinking = thinking
        self.reasoning = ""
        self._content = ""
        self.finish_reason: str | None = None

    @property
    def ended(self) -> bool:
        """A repeated call ended the turn's calls: the rest of the output is not needed."""
        return self._parser is not None and self._parser.ended

    @property
    def content(self) -> str:
        return self._parser.content if self._parser is not None else self._content

    @property
    def calls(self) -> list[Call]:
        return self._parser.calls if self._parser is not None else []

    def feed(self, output: RequestOutput) -> Parts:
        parts = Parts(reasoning=output.reasoning)
        self.reasoning += output.reasoning
        answer = RequestOutput(text=output.text, tokens=output.tokens[output.n_reasoning:], finish_reason=output.finish_reason)
        if self._parser is None:
            parts.content = answer.text
            self._content += answer.text
            return parts
        events = self._parser.feed(answer)
        parts.content, parts.started, parts.arguments = events.content, events.started, events.arguments
        return parts

    def finish(self, finish_reason: str) -> Parts:
        """The last parts (held-back text) once the engine's final output was fed; sets
        `finish_reason`: "tool_calls" for calls that completed (or a turn a repeated call
        ended), else the engine's ("length" for a call cut short)."""
        if self._parser is None:
            self.finish_reason = finish_reason
            return Parts()
        events, self.finish_reason = self._parser.finish(finish_reason)
        return Parts(content=events.content, started=events.started, arguments=events.arguments)

    def message(self) -> dict:
        """Chat's message fields: content (None beside calls, as OpenAI), the reasoning under
        both names clients read (`reasoning_content`, vLLM's first; `reasoning`, its newer),
        the calls."""
        calls = self.calls
        message = {"content": self.content or (None if calls else ""), "refusal": None}
        if self.thinking:
            message["reasoning_content"] = message["reasoning"] = self.reasoning or None
        if calls:
            message["tool_calls"] = [call.wire() for call in calls]
        return message
