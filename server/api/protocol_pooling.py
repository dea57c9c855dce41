"""Wire models of the pooling APIs: OpenAI's /v1/embeddings, and /v1/rerank (the Cohere/Jina
shape vLLM accepts) and /v1/score (vLLM's). Fields in their references' order; unknown fields are
ignored, as in server/api/protocol.py."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from server.api.protocol import OpenAIModel, not_empty

# OpenAI's bound on inputs per embeddings request; rerank and score take as many documents/pairs
MAX_INPUTS = 2048
MAX_TEXT_CHARS = 1_000_000  # one text, before tokenizing (the context bounds it again in tokens)

ModelId = Annotated[str, Field(min_length=1, max_length=256)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenList = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TEXT_CHARS)]


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings: `input` is a string, a list of strings, a list of token ids or a list
    of such lists (each one an input)."""

    input: Union[Text, Annotated[list[Text], Field(max_length=MAX_INPUTS)], TokenList,
                 Annotated[list[TokenList], Field(max_length=MAX_INPUTS)]]
    model: ModelId | None = None
    dimensions: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _not_empty(cls, value):
        return not_empty(value, "input")

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text, or token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class RerankDocument(OpenAIModel):
    text: Text


class RerankRequest(OpenAIModel):
    """POST /v1/rerank: the documents most relevant to `query` first. `instruction` is a decoder
    reranker's task description (Qwen3-Reranker's `<Instruct>`; a cross-encoder takes none)."""

    model: ModelId | None = None
    query: Text
    documents: Annotated[list[Union[Text, RerankDocument]], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True
    instruction: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(OpenAIModel):
    """POST /v1/score (vLLM's): the relevance of each (text_1, text_2) pair: one text_1 against
    each text_2, or lists of equal length paired in order."""

    model: ModelId | None = None
    text_1: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]]
    text_2: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]]
    instruction: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None

    @model_validator(mode="after")
    def _pairs_match(self):
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        return [(firsts[0] if len(firsts) == 1 else firsts[i], second) for i, second in enumerate(seconds)]


class PoolingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingResponse(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: PoolingUsage


class RerankResult(OpenAIModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # with return_documents


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class Score(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage
