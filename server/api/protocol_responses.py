"""OpenAI Responses API wire models (`POST /v1/responses`), with their bounds.

The request converts itself to the chat side's `ChatCompletionRequest` (`to_chat`): a Responses
turn is rendered, constrained, tool-called and sampled exactly as the equivalent chat request, so
the two APIs share one chat template, one grammar path and one tool-call parser.

Items (the conversation) are a discriminated union on `type`; a message may omit it (OpenAI's
"easy input message"). Tags are spelled with a space so that `server.api.errors` leaves them out of
the `param` it reports (`input[2].content[0].type`, not `input[2].message item.content...`).
Unknown fields are ignored, as in `server.api.protocol`; fields kvserve cannot honour and that would
change the meaning of the request (`background`, `conversation`, `prompt`, a `tool_choice` naming
a non-function tool) are refused with a 400 naming them. Tools kvserve cannot run (hosted ones:
`web_search`, `namespace`, `custom`, ...) are dropped, and the response says which
(`protocol.DROPPED_TOOLS_HEADER`): agents such as the Codex CLI send them by default.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from server.api.protocol import (
    INT64, MAX_CONSTRAINT_BYTES, MAX_STOP, MAX_TOKENS_LIMIT, MAX_TOOLS, ChatCompletionRequest, OffersTools, OpenAIModel,
    StopString, not_empty, within_bytes,
)

Text = Annotated[str, Field(max_length=10_000_000)]
CallId = Annotated[str, Field(min_length=1, max_length=256)]
MAX_ITEMS = 4096


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ContentPart(OpenAIModel):
    """A text part of a message: `input_text` (user, system) or `output_text` (assistant)."""

    type: Literal["input_text", "output_text"]
    text: Text


class InputImagePart(OpenAIModel):
    """An image of a user message: `image_url` a data: URL (or http(s) where the server allows
    fetching). A `file_id` is refused: kvserve has no Files API."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1, max_length=100_000_000)] | None = None
    file_id: Annotated[str, Field(max_length=256)] | None = None
    detail: Literal["auto", "low", "high"] = "auto"

    @model_validator(mode="after")
    def _url_only(self):
        if self.file_id is not None:
            raise ValueError("file_id is not supported: kvserve has no Files API; send the image as image_url (a data: URL)")
        if self.image_url is None:
            raise ValueError("image_url is required")
        return self

    def chat(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": self.detail}}


def _message_part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return "image" if kind == "input_image" else "text" if kind in ("input_text", "output_text") else None


MessagePart = Annotated[
    Union[Annotated[ContentPart, Tag("text")], Annotated[InputImagePart, Tag("image")]],
    Discriminator(_message_part_tag, custom_error_type="invalid_content_part",
                  custom_error_message="a content part must be input_text, output_text or input_image"),
]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    id: Annotated[str, Field(max_length=256)] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[MessagePart], Field(max_length=1024)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content if isinstance(p, ContentPart))

    def images(self) -> list[InputImagePart]:
        return [p for p in self.content if isinstance(p, InputImagePart)] if isinstance(self.content, list) else []

    def chat_content(self) -> str | list[dict]:
        """The content as a chat message holds it: text, or its parts where it has images."""
        if not self.images():
            return self.text()
        return [p.chat() if isinstance(p, InputImagePart) else {"type": "text", "text": p.text} for p in self.content]

    def wire(self) -> dict:
        """The item as stored and listed: content always a list of parts, an id always set."""
        part = "output_text" if self.role == "assistant" else "input_text"
        content = [{"type": part, "text": self.content}] if isinstance(self.content, str) else [
            p.model_dump(exclude_none=True) if isinstance(p, InputImagePart) else {"type": p.type, "text": p.text} for p in self.content
        ]
        return {"id": self.id or item_id("msg"), "type": "message", "role": self.role, "content": content, "status": "completed"}


class FunctionCallItem(OpenAIModel):
    """A call the model made earlier; `arguments` is the JSON text it wrote, or, for a call
    `max_output_tokens` cut short ("incomplete"), its arguments so far: accepted as written."""

    type: Literal["function_call"]
    id: Annotated[str, Field(max_length=256)] | None = None
    call_id: CallId
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Text
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def wire(self) -> dict:
        return {
            "id": self.id or item_id("fc"), "type": "function_call", "call_id": self.call_id,
            "name": self.name, "arguments": self.arguments, "status": self.status or "completed",
        }


class InputTextPart(OpenAIModel):
    type: Literal["input_text"]
    text: Text


class FunctionCallOutputItem(OpenAIModel):
    """The caller's result of a function call, matched by `call_id`."""

    type: Literal["function_call_output"]
    id: Annotated[str, Field(max_length=256)] | None = None
    call_id: CallId
    output: Text | Annotated[list[InputTextPart], Field(max_length=1024)]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)

    def wire(self) -> dict:
        return {"id": self.id or item_id("fco"), "type": "function_call_output", "call_id": self.call_id, "output": self.text(), "status": "completed"}


class ReasoningPart(OpenAIModel):
    """A reasoning item's text: `reasoning_text` (its content) or `summary_text` (a summary)."""

    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(OpenAIModel):
    """A thinking model's reasoning before the output that follows it, as kvserve returns it
    (`content`: its reasoning_text) and as clients send it back (the Agents SDK, LangChain);
    `encrypted_content` is accepted and ignored (kvserve keeps no secret of its own)."""

    type: Literal["reasoning"]
    id: Annotated[str, Field(max_length=256)] | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=1024)] = []
    content: Annotated[list[ReasoningPart], Field(max_length=1024)] | None = None
    encrypted_content: Annotated[str, Field(max_length=10_000_000)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The reasoning itself (its content; a summary when that is all it has)."""
        return "".join(p.text for p in (self.content if self.content else self.summary))

    def wire(self) -> dict:
        return reasoning_item(self.id or item_id("rs"), self.text(), self.status or "completed")


def reasoning_item(reasoning_id: str, text: str | None, status: str, *, summary: bool = False) -> dict:
    """The wire form of a reasoning item (as OpenAI's open-weight models: the text as content).
    kvserve writes no summary of its own: asked for one (`reasoning.summary`), the summary is
    the reasoning itself (clients such as LangChain read only summaries)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    summaries = [{"type": "summary_text", "text": text}] if summary and text else []
    return {"id": reasoning_id, "type": "reasoning", "summary": summaries, "content": content, "status": status}


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
        return f"{kind} item" if kind in ITEM_TYPES else None
    return None


Item = Annotated[
    Union[
        Annotated[MessageItem, Tag("message item")],
        Annotated[FunctionCallItem, Tag("function_call item")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output item")],
        Annotated[ReasoningItem, Tag("reasoning item")],
    ],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message="unsupported item: kvserve takes messages (text parts), function_call, function_call_output and reasoning items",
    ),
]


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict]:
    """Items -> chat messages, the one conversion between the two APIs: instructions first (a
    system message), function calls as the assistant's `tool_calls` (a call right after an
    assistant message joins it), outputs as `tool` messages, a reasoning item as the
    `reasoning_content` of the assistant turn it precedes (its chat template decides what it
    keeps). Earlier outputs sent back as input render exactly like stored ones."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    joinable = False  # the last message is an assistant turn a call may join
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.chat_content()})
            joinable = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not joinable:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            joinable = True
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            joinable = False
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


class TextFormat(OpenAIModel):
    """`text.format`: plain text, any JSON object, or JSON valid against `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=256)] | None = None
    description: Annotated[str, Field(max_length=100_000)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_size(cls, value):
        return within_bytes(value, MAX_CONSTRAINT_BYTES, "the output constraint")

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("json_schema needs a schema")
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}}


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(OpenAIModel):
    """A function the model may call (the only tool type kvserve runs)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(OpenAIModel):
    """A tool of any other type (`web_search`, `file_search`, `local_shell`, `custom`, `mcp`,
    `namespace`, ...): one OpenAI runs, or a client-side kind kvserve's grammar cannot write.
    Accepted and dropped (`ResponsesRequest.dropped_tools`)."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(min_length=1, max_length=64)]


def _tool_tag(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return "function tool" if value["type"] == "function" else "hosted tool"
    return None


Tool = Annotated[
    Union[Annotated[FunctionTool, Tag("function tool")], Annotated[HostedTool, Tag("hosted tool")]],
    Discriminator(_tool_tag, custom_error_type="invalid_tool", custom_error_message="a tool must be an object with a string type"),
]


class ReasoningConfig(OpenAIModel):
    """`reasoning`: the effort maps to the model's thinking switch as chat's `reasoning_effort`
    does; summaries are not written (the reasoning itself is returned)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]


class ResponsesRequest(OffersTools):
    """POST /v1/responses. Fields in the order of OpenAI's reference; extensions last."""

    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] | None = None
    input: Text | Annotated[list[Item], Field(max_length=MAX_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=1024)] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    model: Annotated[str, Field(min_length=1, max_length=256)]
    parallel_tool_calls: bool = True
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: Annotated[str, Field(max_length=512)] | None = None
    service_tier: Annotated[str, Field(max_length=64)] | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    text: TextConfig | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None  # logprobs are not returned here
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    # extensions (as on /v1/chat/completions)
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    speculative: bool = True
    max_reasoning_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None  # the thinking budget

    @field_validator("background")
    @classmethod
    def _no_background(cls, value):
        if value:
            raise ValueError("background responses are not supported: kvserve answers while you wait (or streams)")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _unsupported(cls, value, info):
        if value is not None:
            hint = "; continue with previous_response_id" if info.field_name == "conversation" else ""
            raise ValueError(f"not supported by kvserve{hint}")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_not_empty(cls, value):
        return not_empty(value, "input")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def input_items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def text_format(self) -> dict:
        """`text.format` as echoed in the response object."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        return fmt.model_dump(by_alias=True, exclude_none=True)

    def function_tools(self) -> list[FunctionTool]:
        """The tools this turn offers the model: the function tools."""
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    def dropped_tools(self) -> list[str]:
        return [t.type for t in self.tools or () if isinstance(t, HostedTool)]

    def tool_choice_wire(self) -> str | dict:
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def to_chat(self, items: list[Item], max_tokens: int | None, session_id: str | None) -> ChatCompletionRequest:
        """The chat request this turn is: `items` is the whole conversation (stored turns and
        this input). Raises pydantic's ValidationError on messages chat refuses."""
        tool_choice = self.tool_choice
        if isinstance(tool_choice, NamedFunction):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        tools = None
        if self.function_tools():
            tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.function_tools()]
        fmt = self.text.format if self.text is not None else None
        chat = ChatCompletionRequest.model_validate({
            "model": self.model,
            "messages": chat_messages(self.instructions, items),
            "max_completion_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "top_k": self.top_k,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "response_format": fmt.response_format() if fmt is not None else None,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
            "max_reasoning_tokens": self.max_reasoning_tokens,
            "prompt_cache_key": session_id,
            "speculative": self.speculative,
        })
        # the errors about this input's images name their place in it, not in the chat
        first = len(items) - len(self.input_items())
        places = [f"input[{i}].content[{j}]" for i, item in enumerate(items[first:]) if isinstance(item, MessageItem)
                  for j, part in enumerate(item.content if isinstance(item.content, list) else ()) if isinstance(part, InputImagePart)]
        for image, place in zip(chat.images()[len(chat.images()) - len(places):], places):
            image._where = place
        return chat


class InputItemsQuery(OpenAIModel):
    """GET /v1/responses/{id}/input_items: cursor pagination as OpenAI's."""

    after: Annotated[str, Field(max_length=256)] | None = None
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
