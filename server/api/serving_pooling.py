"""The serving side of the pooling tasks (--task embed, rerank): what /v1/embeddings, /v1/rerank and
/v1/score do between the wire models (server/api/protocol_pooling.py) and the pooling engine
(server/engine/pooling.py): inputs tokenized and bounded, submitted together, answers built.

A reranker's pairs become model inputs through one `PairFormat` chosen at start-up: a
cross-encoder's tokenizer pair (query, document), or Qwen3-Reranker's yes/no prompt.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from fastapi import Request
from transformers import PreTrainedTokenizerBase

from server.api import limits
from server.api.errors import APIError
from server.api.protocol_pooling import (
    Embedding, EmbeddingRequest, EmbeddingResponse, PoolingUsage, RerankDocument, RerankRequest, RerankResponse, RerankResult,
    Score, ScoreRequest, ScoreResponse,
)
from server.api.serving import RETRY_AFTER_S, new_id, timed_out
from server.engine.core import EngineStopped, QueueFull
from server.engine.pooling import Pooler, PoolingInput
from server.engine.pooling_spec import PoolingSpec
from server.metrics import Metrics


# Qwen3-Reranker's prompt (its model card): a system turn asking for "yes" or "no", the user turn
# with the instruction, query and document, and an empty thinking block before the answer
YES_NO_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
                 'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class PairFormat(Protocol):
    """How a reranker reads a (query, document) pair: its model input (blocking: tokenizes)."""

    def encode(self, query: str, document: str, instruction: str | None) -> PoolingInput: ...


class CrossEncoderPairs:
    """A cross-encoder's input: the tokenizer's pair encoding, its segments' token types included
    (as sentence-transformers' CrossEncoder tokenizes); no instruction."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.typed = "token_type_ids" in tokenizer.model_input_names

    def encode(self, query: str, document: str, instruction: str | None) -> PoolingInput:
        if instruction is not None:
            raise APIError(400, "instruction: a cross-encoder reranker takes no instruction (a decoder reranker, as "
                           "Qwen3-Reranker, does)", code="invalid_value", param="instruction", rejection="bad_request")
        encoded = self.tokenizer(query, document, return_token_type_ids=self.typed)
        return PoolingInput(encoded["input_ids"], encoded["token_type_ids"] if self.typed else None)


class YesNoPrompt:
    """Qwen3-Reranker's input: `YES_NO_PREFIX`, `<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`
    and `YES_NO_SUFFIX`, each part tokenized alone and joined, as its model card does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.prefix = tokenizer.encode(YES_NO_PREFIX, add_special_tokens=False)
        self.suffix = tokenizer.encode(YES_NO_SUFFIX, add_special_tokens=False)

    @staticmethod
    def text(query: str, document: str, instruction: str | None) -> str:
        return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"

    def encode(self, query: str, document: str, instruction: str | None) -> PoolingInput:
        return PoolingInput(self.prefix + self.tokenizer(self.text(query, document, instruction))["input_ids"] + self.suffix)


@dataclass(slots=True)
class PoolingContext:
    """What the pooling routes need, built once at start-up (server/startup.py): the pooling
    engine (`engine`, named as the generation context's so that the app's lifecycle treats both
    alike), and the served model's facts."""

    engine: Pooler
    tokenizer: PreTrainedTokenizerBase
    metrics: Metrics
    task: str  # "embed" or "rerank"
    model_id: str
    model_aliases: frozenset[str]
    max_context: int
    vocab_size: int
    request_timeout_s: float  # --request-timeout-s: a request's deadline, queueing included
    pooling: PoolingSpec | None = None  # embed: how vectors are pooled
    dimensions: int = 0  # embed: the length of a full vector
    matryoshka: tuple[int, ...] | bool = False  # embed: the lengths it may be cut to (True: any)
    pairs: PairFormat | None = None  # rerank: how a (query, document) pair is read
    vision = None  # no images here (AppState.body_limit asks)

    def check_model(self, model: str | None) -> None:
        """404 `model_not_found` unless `model` (when given) is the served model or an alias."""
        if model is not None and model != self.model_id and model not in self.model_aliases:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_id}'.",
                           code="model_not_found", param="model", rejection="bad_request")

    def bounded(self, x: PoolingInput, param: str) -> PoolingInput:
        """`x`, or 400 when it is empty or longer than the context (nothing is truncated), or holds
        a token id outside the vocabulary."""
        ids = x.ids
        if not ids:
            raise APIError(400, f"{param}: an input holds no tokens", code="invalid_value", param=param, rejection="bad_request")
        if len(ids) > self.max_context:
            raise limits.context_exceeded(self.max_context, f"an input holds {len(ids)} tokens", f"the length of the {param}", param)
        if (bad := max(ids)) >= self.vocab_size:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {self.vocab_size})", code="invalid_value",
                           param=param, rejection="bad_request")
        return x

    async def run(self, request: Request, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        """Each input's result from the pooling engine; the HTTP answer to a refusal. Past the
        request's deadline (--request-timeout-s) a 504, and once the client has gone nothing more
        is computed for it: its rows not yet run are dropped."""
        try:
            future = self.engine.submit(inputs, asyncio.get_running_loop())
        except QueueFull as exc:
            raise APIError(429, f"server busy: {exc}; retry later", code="queue_full", headers={"Retry-After": RETRY_AFTER_S},
                           rejection="queue_full") from None
        except EngineStopped:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": RETRY_AFTER_S}) from None
        watcher = asyncio.create_task(_cancel_when_gone(request, future))
        try:
            results = await asyncio.wait_for(future, self.request_timeout_s)
        except TimeoutError:
            raise timed_out(self.request_timeout_s) from None
        except asyncio.CancelledError:
            if not watcher.done():  # this task itself was cancelled (the server stopping)
                raise
            raise APIError(499, "the client closed the request", code="client_closed") from None
        except EngineStopped:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": RETRY_AFTER_S}) from None
        except Exception:  # noqa: BLE001 - logged by the engine thread; no internals to the client
            raise APIError(500, "the forward pass failed; the server log says why", code="internal_error") from None
        finally:
            watcher.cancel()
        self.metrics.pooled_inputs.labels(self.task).inc(len(inputs))
        self.metrics.pooled_tokens.labels(self.task).inc(sum(len(x.ids) for x in inputs))
        return results


async def _cancel_when_gone(request: Request, future: asyncio.Future) -> None:
    """Cancel `future` once the client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    future.cancel()


def _tokenize(ctx: PoolingContext, texts: list[str | list[int]], param: str) -> list[PoolingInput]:
    """Texts as the tokenizer encodes them with its special tokens (as sentence-transformers
    does); token ids as they are. Blocking."""
    return [ctx.bounded(PoolingInput(t if isinstance(t, list) else limits.prompt_ids(ctx.tokenizer, t, ctx.max_context, param)), param)
            for t in texts]


def _cut(ctx: PoolingContext, dimensions: int | None) -> int | None:
    """The length vectors are cut to (None: whole), or 400 when the model cannot give it."""
    if dimensions is None or dimensions == ctx.dimensions:
        return None
    if not ctx.matryoshka:
        raise APIError(400, f"dimensions: this model's embeddings have {ctx.dimensions} dimensions and it was not trained to "
                       "be cut shorter (no matryoshka_dimensions or is_matryoshka in its config)", code="invalid_value",
                       param="dimensions", rejection="bad_request")
    listed = isinstance(ctx.matryoshka, tuple)
    if not (dimensions in ctx.matryoshka if listed else dimensions < ctx.dimensions):
        lengths = ", ".join(map(str, ctx.matryoshka)) if listed else f"1 to {ctx.dimensions}"
        raise APIError(400, f"dimensions: this model's embeddings may be cut to {lengths} dimensions, not {dimensions}",
                       code="invalid_value", param="dimensions", rejection="bad_request")
    return dimensions


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: the float32 array's little-endian bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def embed(ctx: PoolingContext, body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    ctx.check_model(body.model)
    cut = _cut(ctx, body.dimensions)
    inputs = await asyncio.to_thread(_tokenize, ctx, body.inputs(), "input")
    # NOTE: numpy, not torch, past the engine: only the engine thread runs torch ops (one OpenMP team)
    vectors = np.stack([v.numpy() for v in await ctx.run(request, inputs)])
    if cut is not None:  # Matryoshka: the first dimensions, normalized again if the model normalizes
        vectors = vectors[:, :cut]
        if ctx.pooling.normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    tokens = sum(len(x.ids) for x in inputs)
    return EmbeddingResponse(
        data=[Embedding(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)],
        model=body.model or ctx.model_id, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def _scores(ctx: PoolingContext, request: Request, pairs: list[tuple[str, str]], instruction: str | None, param: str) -> tuple[list[float], int]:
    def encode() -> list[PoolingInput]:
        return [ctx.bounded(ctx.pairs.encode(q, d, instruction), param) for q, d in pairs]

    inputs = await asyncio.to_thread(encode)
    scores = await ctx.run(request, inputs)
    return [float(s) for s in scores], sum(len(x.ids) for x in inputs)


async def rerank(ctx: PoolingContext, body: RerankRequest, request: Request) -> RerankResponse:
    ctx.check_model(body.model)
    texts = body.texts()
    scores, tokens = await _scores(ctx, request, [(body.query, t) for t in texts], body.instruction, "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n or None]
    return RerankResponse(
        id=new_id("rerank"), model=body.model or ctx.model_id, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
        results=[RerankResult(index=i, relevance_score=scores[i], document=RerankDocument(text=texts[i]) if body.return_documents else None)
                 for i in order],
    )


async def score(ctx: PoolingContext, body: ScoreRequest, request: Request) -> ScoreResponse:
    ctx.check_model(body.model)
    scores, tokens = await _scores(ctx, request, body.pairs(), body.instruction, "text_2")
    return ScoreResponse(
        id=new_id("score"), created=int(time.time()), model=body.model or ctx.model_id,
        data=[Score(index=i, score=s) for i, s in enumerate(scores)], usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
