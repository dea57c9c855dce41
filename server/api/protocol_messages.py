"""Anthropic Messages API wire models (`POST /v1/messages`, `/v1/messages/count_tokens`).

The request converts itself to the chat side's `ChatCompletionRequest` (`to_chat`), as the
Responses API's does: a Messages turn is rendered, constrained, tool-called and sampled exactly as
the equivalent chat request. The conversion, block by block:

* `system` (a string or text blocks) -> a system message;
* a user message's `text` and `image` blocks -> a user message (images as data: or http(s) URLs);
  each `tool_result` block -> a `tool` message (its text, and its images);
* an assistant message's `thinking` blocks -> its `reasoning_content`, `text` -> its content,
  `tool_use` -> its `tool_calls` (the input as the parsed object templates expect);
* `tools` (client tools: `input_schema`) -> function tools; server tools (`web_search_...`,
  `bash_...`, any other `type`) are dropped and named in the dropped-tools header;
* `tool_choice` auto / any / tool / none -> auto / required / the named function / none, and
  `disable_parallel_tool_use` -> one call at most;
* `thinking` enabled, adaptive or between_tools -> the model's thinking switch on (enabled's
  `budget_tokens` its budget); disabled -> off; absent -> the model's default;
  `output_config.effort` -> chat's `reasoning_effort`;
* `output_config.format` (a JSON schema) -> chat's `response_format`: the answer is valid JSON of it.

Blocks of kinds kvserve does not take (`document`, `search_result`, ...) are a 400 naming them;
`cache_control` is accepted everywhere and changes nothing (kvserve reuses every prefix it holds);
`redacted_thinking` blocks (kvserve never writes them) are accepted and not rendered.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from server.api.protocol import (
    MAX_CONSTRAINT_BYTES, MAX_STOP, MAX_TOKENS_LIMIT, MAX_TOOLS, ChatCompletionRequest, OffersTools, OpenAIModel, StopString, within_bytes,
)

Text = Annotated[str, Field(max_length=10_000_000)]
Name = Annotated[str, Field(min_length=1, max_length=256)]
MAX_BLOCKS = 1024


class Block(OpenAIModel):
    """What every content block may carry besides its own fields."""

    cache_control: dict[str, Any] | None = None  # accepted: kvserve reuses every prefix it holds


class TextBlock(Block):
    type: Literal["text"]
    text: Text


class Base64Source(OpenAIModel):
    type: Literal["base64"]
    media_type: Annotated[str, Field(max_length=64)]
    data: Annotated[str, Field(min_length=1, max_length=100_000_000)]


class URLSource(OpenAIModel):
    type: Literal["url"]
    url: Annotated[str, Field(min_length=1, max_length=100_000)]


class ImageBlock(Block):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]

    def chat(self) -> dict:
        """The chat side's image part: base64 data as a data: URL (server/api/media.py reads it)."""
        source = self.source
        url = source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(Block):
    """A call the model made earlier (as kvserve returned it)."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Name
    input: dict[str, Any]


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(Block):
    """The caller's result of a call, matched by `tool_use_id`; `is_error` is accepted and the
    content rendered as it is (tools' errors say so in their text)."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: Text | Annotated[list[ResultPart], Field(max_length=MAX_BLOCKS)] = ""
    is_error: bool = False

    def chat_content(self) -> str | list[dict]:
        if isinstance(self.content, str):
            return self.content
        if not any(isinstance(p, ImageBlock) for p in self.content):
            return "".join(p.text for p in self.content)
        return [p.chat() if isinstance(p, ImageBlock) else {"type": "text", "text": p.text} for p in self.content]


class ThinkingBlock(Block):
    """A thinking model's reasoning before the answer it precedes, with the `signature` kvserve
    gave it (checked when it comes back: server/api/serving_messages.py)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Annotated[str, Field(max_length=1024)]


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: Annotated[str, Field(max_length=10_000_000)]


BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in BLOCK_TYPES else None


ContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[ToolUseBlock, Tag("tool_use")],
        Annotated[ToolResultBlock, Tag("tool_result")],
        Annotated[ThinkingBlock, Tag("thinking")],
        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    ],
    Discriminator(_block_tag, custom_error_type="invalid_content_block",
                  custom_error_message=f"a content block must be one of {', '.join(BLOCK_TYPES)}"),
]
_BLOCKS_OF = {
    "user": (TextBlock, ImageBlock, ToolResultBlock),
    "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
    "system": (TextBlock,),
}


class Message(OpenAIModel):
    """A turn; a `system` message (text only: Claude Code sends them between turns) renders as a
    system message where it stands."""

    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]

    @model_validator(mode="after")
    def _blocks_of_role(self):
        allowed = _BLOCKS_OF[self.role]
        for block in self.blocks():
            if not isinstance(block, allowed):
                raise ValueError(f"a {self.role} message cannot hold a {block.type} block")
        return self

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(OpenAIModel):
    """A client tool (`input_schema`), or a server tool of Anthropic's (any other `type`:
    `web_search_20250305`, `bash_20250124`, ...), which kvserve cannot run: dropped."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(max_length=64)] | None = None
    name: Name
    description: Annotated[str, Field(max_length=100_000)] | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_for_client_tools(self):
        if self.client and self.input_schema is None:
            raise ValueError("input_schema is required for a client tool")
        return self

    @property
    def client(self) -> bool:
        return self.type in (None, "custom")

    def chat(self) -> dict:
        """The chat tool, its fields in OpenAI's order (templates render them as given)."""
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        return self

    def chat(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(OpenAIModel):
    """`enabled` (with its budget), `adaptive` and `between_tools` turn the model's thinking on,
    `disabled` off; `display: omitted` returns thinking blocks with their signature and no text."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required when thinking is enabled")
        return self


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_size(cls, value):
        return within_bytes(value, MAX_CONSTRAINT_BYTES, "the output constraint")


class OutputConfig(OpenAIModel):
    """`effort` maps to the model's thinking switch as chat's `reasoning_effort` does (xhigh and
    max as high); `format` constrains the answer to JSON valid against its schema."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(OpenAIModel):
    user_id: Annotated[str, Field(max_length=512)] | None = None
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # kvserve: the session to continue in


class ConversationFields(OffersTools):
    """What a Messages request and a count_tokens request share: the conversation and its tools."""

    model: Name
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted, as on blocks

    @property
    def prefilled(self) -> bool:
        """The last message is the assistant's: the answer continues it (Anthropic's prefill)."""
        return self.messages[-1].role == "assistant"

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_runs(cls, value):
        return value  # Anthropic's kinds (ToolChoice) all run: this replaces OffersTools' OpenAI rule

    def dropped_tools(self) -> list[str]:
        return [t.type for t in self.tools or () if not t.client]

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(block.text for block in self.system) or None

    def places(self):
        """(message index, block index, block) of every block of the conversation."""
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, block in enumerate(message.content):
                    yield i, j, block

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages (the module docstring says how)."""
        system = self.system_text()
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            if message.role == "assistant":
                messages.append(_assistant(message.blocks()))
                continue
            if message.role == "system":
                messages.append({"role": "system", "content": "".join(b.text for b in message.blocks())})
                continue
            parts: list = []
            for block in message.blocks():
                if isinstance(block, ToolResultBlock):
                    if parts:
                        messages.append(_user(parts))
                        parts = []
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.chat_content()})
                else:
                    parts.append(block)
            if parts:
                messages.append(_user(parts))
        return messages

    def reasoning_controls(self) -> tuple[str | None, int | None]:
        """(chat's reasoning_effort, thinking budget) of `thinking` and `output_config.effort`."""
        effort = self.output_config.effort if self.output_config is not None else None
        effort = "high" if effort in ("xhigh", "max") else effort
        if self.thinking is None:
            return effort, None
        if self.thinking.type == "disabled":
            return "none", None
        return effort or "medium", self.thinking.budget_tokens

    @property
    def omits_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    def chat_fields(self) -> dict:
        """The chat request's fields of the conversation, its tools and its thinking."""
        effort, budget = self.reasoning_controls()
        tools = [t.chat() for t in self.tools or () if t.client] or None
        choice = self.tool_choice
        return {
            "model": self.model,
            "messages": self.chat_messages(),
            "tools": tools,
            "tool_choice": choice.chat() if choice is not None and tools else None,
            "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
            "reasoning_effort": effort,
            "max_reasoning_tokens": budget,
            "response_format": self.response_format(),
        }

    def response_format(self) -> dict | None:
        fmt = self.output_config.format if self.output_config is not None else None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}} if fmt is not None else None

    def to_chat(self, **fields) -> ChatCompletionRequest:
        """The chat request this conversation is (`fields`: the request's own sampling fields).
        Raises pydantic's ValidationError on messages chat refuses; the errors about images
        name their place in this conversation."""
        chat = ChatCompletionRequest.model_validate(self.chat_fields() | fields)
        places = [f"messages[{i}].content[{j}]" + (f".content[{k}]" if k is not None else "")
                  for i, j, block in self.places() for k, image in _images(block)]
        for image, place in zip(chat.images(), places):
            image._where = place
        return chat


def _images(block) -> list[tuple[int | None, ImageBlock]]:
    if isinstance(block, ImageBlock):
        return [(None, block)]
    if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
        return [(k, part) for k, part in enumerate(block.content) if isinstance(part, ImageBlock)]
    return []


def _user(blocks: list) -> dict:
    if not any(isinstance(b, ImageBlock) for b in blocks):
        return {"role": "user", "content": "".join(b.text for b in blocks)}
    return {"role": "user", "content": [b.chat() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text} for b in blocks]}


def _assistant(blocks: list) -> dict:
    message: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}} for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return message


class MessagesRequest(ConversationFields):
    """POST /v1/messages. Fields in the order of Anthropic's reference; extensions last."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
    metadata: Metadata | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    service_tier: Annotated[str, Field(max_length=64)] | None = None  # accepted; one tier here
    # extensions (as on /v1/chat/completions)
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    speculative: bool = True

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        if self.thinking is not None and self.thinking.budget_tokens is not None and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than max_tokens ({self.max_tokens})")
        return self

    @property
    def session_id(self) -> str | None:
        return self.metadata.session_id if self.metadata is not None else None

    def chat(self) -> ChatCompletionRequest:
        return self.to_chat(
            max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, prompt_cache_key=self.session_id, speculative=self.speculative,
            user=self.metadata.user_id if self.metadata is not None else None,
        )


class CountTokensRequest(ConversationFields):
    """POST /v1/messages/count_tokens: what the conversation costs as input tokens."""


def tool_input(arguments: str) -> dict:
    """A call's input object from the arguments the model wrote ({} for arguments cut short)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
