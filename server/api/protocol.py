"""OpenAI wire models (requests) with their bounds; the engine never imports this module.

Fields follow the order of OpenAI's API reference, extensions (top_k, structured outputs) last.
Unknown fields are ignored, as OpenAI's own clients send fields a server may not know. Each
request converts itself to the engine's `SamplingParams`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.engine.sampling import SamplingParams

MAX_N = 16
MAX_STOP = 4
MAX_PROMPTS = 64
MAX_TOKENS_LIMIT = 1_000_000
MAX_TOOLS = 128
# Bytes of compact JSON (text: UTF-8): a request's whole tool list, and each output constraint
# (response_format, structured_outputs, guided_*). Both are compiled into a grammar before the
# request is queued; the largest JSONSchemaBench schema is 37 KB.
MAX_TOOLS_BYTES = 512 * 1024
MAX_CONSTRAINT_BYTES = 256 * 1024
INT64 = 2**63

StopString = Annotated[str, Field(min_length=1, max_length=1024)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=MAX_TOKENS_LIMIT)]


def not_empty(value, param: str):
    """`value`, unless it is an empty list: OpenAI's `empty_array` error, naming `param`."""
    if isinstance(value, list) and not value:
        raise PydanticCustomError(
            "empty_array", f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        )
    return value


def within_bytes(value, limit: int, what: str):
    """`value`, unless its compact JSON is larger than `limit` bytes: a ValueError saying both
    sizes (the 400 names the field). Runs before the field's own validation."""
    if value is None:
        return value
    try:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
    except RecursionError:
        raise ValueError(f"{what} nests too deeply") from None
    except ValueError:  # a circular container (only from Python callers)
        raise ValueError(f"{what} is not JSON") from None
    if size > limit:
        raise ValueError(f"{what} is {size} bytes of JSON; at most {limit} are accepted")
    return value


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


DROPPED_TOOLS_HEADER = "X-Kvserve-Dropped-Tools"


class OffersTools(OpenAIModel):
    """The tool rule of every API that takes `tools`: kvserve runs function tools only. A tool of
    any other type (`web_search`, `custom`, ...) is dropped and named in the dropped-tools header
    (`dropped_tools()`); a `tool_choice` naming one is a 400, since the answer could not follow it."""

    @field_validator("tools", mode="before", check_fields=False)
    @classmethod
    def _tools_size(cls, value):
        return within_bytes(value, MAX_TOOLS_BYTES, "the tool list")

    @field_validator("tool_choice", mode="before", check_fields=False)
    @classmethod
    def _tool_choice_runs(cls, value):
        if isinstance(value, dict) and value.get("type", "function") != "function":
            raise ValueError(
                f"a tool_choice of type {value.get('type')!r} is not supported: kvserve runs function tools only "
                "(tools of other types are dropped); use 'auto', 'none', 'required' or a function tool's name"
            )
        return value

    def dropped_tools(self) -> list[str]:
        """The types of the tools kvserve dropped, in request order."""
        raise NotImplementedError

    def dropped_tools_header(self) -> dict[str, str]:
        """The header naming the dropped tools' types, each once; none when nothing was dropped."""
        dropped = self.dropped_tools()
        return {DROPPED_TOOLS_HEADER: ", ".join(dict.fromkeys(dropped))} if dropped else {}


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=10_000_000)]


class ImageURL(OpenAIModel):
    url: Annotated[str, Field(min_length=1, max_length=100_000_000)]  # a data: URL, or http(s) where allowed
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes the image


class ImagePart(OpenAIModel):
    """An image of a message (server/api/media.py reads it). `where` is the path the errors
    about it name (`messages[i].content[j]`, or the Responses input's own)."""

    type: Literal["image_url"]
    image_url: ImageURL
    _where: str = PrivateAttr(default="")

    @property
    def where(self) -> str:
        return self._where


def _part_tag(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) and value.get("type") in ("text", "image_url") else None


ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("text")], Annotated[ImagePart, Tag("image_url")]],
    Discriminator(_part_tag, custom_error_type="invalid_content_part",
                  custom_error_message="a content part must be {'type': 'text', ...} or {'type': 'image_url', ...}"),
]
IMAGE_ROLES = ("user", "tool")  # the roles whose messages may hold images (OpenAI's: user)


class FunctionCall(OpenAIModel):
    """A function call in an earlier assistant turn; `arguments` is the text the model wrote
    (OpenAI's wire format: JSON) or, leniently, an already parsed object.

    NOTE: any string is accepted: a call that max_tokens cut short holds its arguments so far,
    and its conversation must stay continuable as the model wrote it."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=10_000_000)] | dict[str, Any] = "{}"


class ToolCall(OpenAIModel):
    id: Annotated[str, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message. Role rules (OpenAI's): only assistant messages carry `tool_calls`, only
    tool messages carry `tool_call_id` and must; every role but assistant needs `content`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=10_000_000)] | Annotated[list[ContentPart], Field(max_length=1024)] | None = Field(
        None, validate_default=True
    )
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(None, validate_default=True)
    # an earlier answer's thinking, as kvserve (and vLLM) return it: the template decides what it keeps
    reasoning_content: Annotated[str, Field(max_length=10_000_000)] | None = None
    reasoning: Annotated[str, Field(max_length=10_000_000)] | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is None and role not in (None, "assistant"):
            raise ValueError(f"required for role {role!r}")
        if isinstance(value, list) and role not in (None, *IMAGE_ROLES) and any(isinstance(p, ImagePart) for p in value):
            raise ValueError(f"images are taken in {' and '.join(IMAGE_ROLES)} messages, not in role {role!r}")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_only_for_assistant(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is not None and role not in (None, "assistant"):
            raise ValueError(f"only assistant messages may have tool_calls, not role {role!r}")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_for_tool(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is None and role == "tool":
            raise ValueError("required for role 'tool'")
        if value is not None and role not in (None, "tool"):
            raise ValueError(f"only tool messages may have tool_call_id, not role {role!r}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[ImagePart]:
        return [p for p in self.content or () if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def for_template(self) -> dict[str, Any]:
        """The dict a chat template expects: role + plain-text content (+ tool fields); a
        message with images keeps its parts, each image as `{"type": "image"}` (the
        vision-language templates' convention)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = self.text()
        if self.images():
            out["content"] = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in self.content]
        for key in ("name", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":
            out["reasoning_content"] = out["thinking"] = thinking  # Qwen3's and DeepSeek's name, gpt-oss's
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return out


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by chat and completions requests."""

    model: Annotated[str, Field(min_length=1, max_length=256)]
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    response_format: dict[str, Any] | None = None
    # extensions
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: one of json, regex, choice, grammar
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spellings of the same
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=1024)] | None = None
    guided_grammar: str | None = None
    speculative: bool = True  # kvserve: false = no speculative decoding for this request

    @field_validator("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", mode="before")
    @classmethod
    def _constraint_size(cls, value):
        return within_bytes(value, MAX_CONSTRAINT_BYTES, "the output constraint")

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_max_stop(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(value)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, value):
        for key in value if isinstance(value, dict) else ():
            digits = key.strip() if isinstance(key, str) else ""
            # NOTE: str.isdigit() alone accepts '²' and other Unicode digits int() refuses.
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias keys are token ids written as strings (OpenAI's wire format)."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    def sampling_params(self, max_tokens: int, *, logprobs: bool, top_logprobs: int, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=None if self.seed is None else self.seed + seed_offset,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias_ids(),
            stop=self.stop_strings(),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )


class ChatCompletionRequest(SamplingFields, OffersTools):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    logprobs: bool = False
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    parallel_tool_calls: bool = True  # OpenAI's default: "required" and "auto" may make several calls
    tool_choice: str | dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # extensions (vLLM's spelling): the template's thinking switches; kvserve: the thinking budget
    chat_template_kwargs: dict[str, Any] | None = None
    max_reasoning_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    _dropped: list[str] = PrivateAttr(default_factory=list)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_not_empty(cls, value):
        return not_empty(value, "messages")

    @model_validator(mode="after")
    def _name_images(self):
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, ImagePart) and not part.where:
                    part._where = f"messages[{i}].content[{j}]"
        return self

    def images(self) -> list[ImagePart]:
        """Every image of the conversation, in order."""
        return [image for message in self.messages for image in message.images()]

    @model_validator(mode="after")
    def _drop_hosted_tools(self):
        self._dropped = [str(t["type"]) for t in self.tools or () if t.get("type", "function") != "function"]
        if self._dropped:
            self.tools = [t for t in self.tools if t.get("type", "function") == "function"] or None
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def dropped_tools(self) -> list[str]:
        return self._dropped

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        return self.sampling_params(
            max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            seed_offset=seed_offset,
        )


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(max_length=10_000_000)]
        | Annotated[list[Annotated[str, Field(max_length=10_000_000)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # NOTE: the legacy Completions API defaults to 16 tokens, and clients rely on it.
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] = 16

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """Names the shape rule that failed; pydantic's union would report one branch at random
        ("prompt[0]: should be a valid integer" for 65 strings)."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("must not be an empty list")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return value  # one prompt of token ids
        if not (all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)):
            raise ValueError("a list must hold only strings, only token ids, or only lists of token ids")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        return self.sampling_params(
            max_tokens,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            seed_offset=seed_offset,
        )


class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's shape): a `prompt`, or chat `messages` rendered by the model's
    template (with `tools`, the thinking switches in `chat_template_kwargs`, and the generation
    prompt, or the last message left open with `continue_final_message`)."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt: Annotated[str, Field(max_length=10_000_000)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template writes them)
    return_token_strs: bool = False
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        if self.add_generation_prompt and self.continue_final_message and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("'add_generation_prompt' and 'continue_final_message' cannot both be true")
        if self.messages is not None:  # checked as chat checks them: a bad conversation is a 400 here too
            try:
                self._chat = ChatCompletionRequest(model=self.model or "served", messages=self.messages, tools=self.tools,
                                                   chat_template_kwargs=self.chat_template_kwargs)
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
        return self

    @property
    def chat(self) -> ChatCompletionRequest | None:
        """The messages as a chat request (the one path chat prompts are rendered by); None for a prompt."""
        return self._chat


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    tokens: TokenIds


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the served context
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str
