"""The served model's dialect: how it writes tool calls and its reasoning, read from its
tokenizer once at start-up (`read`) into one record that the grammar specs, the tool-call
parser, the reasoning tracker and the output assembly all take."""

from __future__ import annotations

from dataclasses import dataclass

from grammars import ToolFormat, output_format, tool_format
from server.api.reasoning import ReasoningFormat, reasoning_format


@dataclass(frozen=True)
class Dialect:
    tools: ToolFormat | None  # the model's own tool-call format (grammars/tool_formats.py); None: kvserve's wrappers
    reasoning: ReasoningFormat | None  # its reasoning markers (server/api/reasoning.py); None: it does not think

    @property
    def calls(self) -> ToolFormat:
        """The format tool calls are written in: the model's own, else kvserve's."""
        return output_format(self.tools)

    @property
    def channels(self) -> bool:
        """The output is a run of messages whose final channel is the answer (gpt-oss's harmony),
        so it is always parsed, with tools or without."""
        return self.tools is not None and self.tools.name == "harmony"


PLAIN = Dialect(None, None)
"""A model without markers of its own (and a request rendered without a tokenizer)."""


def read(tokenizer, reasoning_parser: str | None = None) -> Dialect:
    """The tokenizer's dialect. `reasoning_parser`: --reasoning-parser, None ("auto") detects
    it (`reasoning.reasoning_format`)."""
    return Dialect(tool_format(tokenizer), reasoning_format(tokenizer, reasoning_parser))
