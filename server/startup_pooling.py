"""The composition root of the pooling tasks (--task embed, rerank): the pooling engine over the
head the model's kind needs, and the facts the routes answer with (server/startup.py's `start`
calls it instead of building a generation engine when the model was loaded for one of them).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from server import exits
from server.api.serving_pooling import CrossEncoderPairs, PoolingContext, YesNoPrompt
from server.engine.pooling import ClassifierHead, EmbedHead, Pooler, PoolingInput, YesNoHead
from server.engine.unsupported import UnsupportedModel
from server.metrics import Metrics
from server.model_loader import LoadedModel
from server.settings import Settings

log = logging.getLogger(__name__)


def build_pooling_context(settings: Settings, loaded: LoadedModel, metrics: Metrics) -> PoolingContext:
    """The serving context of a model loaded for a pooling task (--task embed, rerank): the
    pooling engine over the head its kind needs, no KV cache and no generation engine. A model
    the task cannot use is refused by name (UnsupportedModel). The engine is not started yet."""
    config, tokenizer = loaded.model.config, loaded.tokenizer
    max_context = loaded.context_length(settings.max_model_len)
    pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else (tokenizer.pad_token_id or 0)
    facts: dict = {}
    if loaded.task == "embed":
        head = EmbedHead(loaded.pooling)
        facts = {"pooling": loaded.pooling, "matryoshka": matryoshka(config),
                 "dimensions": config.get_text_config().hidden_size * len(loaded.pooling.modes)}
        log.info("embeddings: %s, %d dimensions", loaded.pooling.describe(), facts["dimensions"])
    elif type(loaded.model).__name__.endswith("ForSequenceClassification"):
        head, facts["pairs"] = ClassifierHead(classifier_activation(config)), CrossEncoderPairs(tokenizer)
        log.info("reranking: a cross-encoder, score = %s of its logit", head.activation.__name__)
    else:
        yes, no = (tokenizer.convert_tokens_to_ids(word) for word in ("yes", "no"))
        if not isinstance(yes, int) or not isinstance(no, int) or tokenizer.unk_token_id in (yes, no):
            raise UnsupportedModel("reranker", "a decoder served with --task rerank is scored by its \"yes\" and \"no\" tokens "
                                   "(as Qwen3-Reranker), and this tokenizer has no such tokens")
        head, facts["pairs"] = YesNoHead(yes, no), YesNoPrompt(tokenizer)
        log.info("reranking: a decoder, score = P(yes) of its next token (Qwen3-Reranker's prompt)")
    pooler = Pooler(loaded.model, head, pad_id=pad_id, max_batch_tokens=settings.max_batch_tokens, max_queue=settings.max_queue)
    return PoolingContext(
        engine=pooler, tokenizer=tokenizer, metrics=metrics, task=loaded.task, model_id=settings.served_model_name or loaded.model_id,
        model_aliases=frozenset(settings.model_aliases) | {loaded.model_id}, max_context=max_context,
        vocab_size=config.get_text_config().vocab_size, request_timeout_s=settings.request_timeout_s, **facts,
    )


def matryoshka(config) -> tuple[int, ...] | bool:
    """The lengths an embedding model's vectors may be cut to, as vLLM reads them from its config:
    `matryoshka_dimensions` (those), `is_matryoshka` (any), else none (False)."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return bool(getattr(config, "is_matryoshka", False))


def classifier_activation(config):
    """The function of a cross-encoder's one logit that is its score, as sentence-transformers'
    CrossEncoder.predict applies it: the checkpoint's `sentence_transformers.activation_fn`
    (Sigmoid or Identity), else sigmoid."""
    if config.num_labels != 1:
        raise UnsupportedModel("reranker", f"a sequence-classification reranker has one output (a relevance logit); this one has "
                               f"{config.num_labels} labels")
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or getattr(
        config, "sbert_ce_default_activation_function", None) or "torch.nn.Sigmoid"
    kind = str(named).rsplit(".", 1)[-1]
    if kind not in ("Sigmoid", "Identity"):
        raise UnsupportedModel("reranker", f"the checkpoint's score activation {named} is not one kvserve applies (Sigmoid, Identity)")
    return torch.sigmoid if kind == "Sigmoid" else _identity


def _identity(logits):
    return logits


async def warm_up_pooling(ctx: PoolingContext) -> None:
    """One real input through the pooling engine, so the first request pays for no lazy
    initialisation; StartupError when it fails."""
    if ctx.pairs is not None:
        item = await asyncio.to_thread(ctx.pairs.encode, "Hello", "Hello", None)
    else:
        item = PoolingInput([t % ctx.vocab_size for t in ctx.tokenizer("Hello")["input_ids"]] or [0])
    try:
        await ctx.engine.submit([item], asyncio.get_running_loop())
    except Exception as exc:  # noqa: BLE001 - any failure: the server cannot pool
        raise exits.StartupError(exits.MODEL_CANNOT_RUN, f"a warm-up pooling request failed ({exc}); the server log says why") from exc
