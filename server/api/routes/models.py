"""GET /v1/models: the served model, then each LoRA adapter as a model of its own (aliases are
accepted in requests, not listed). A model served for a pooling task (--task embed, rerank) is
listed with its task and no KV cache."""

from fastapi import APIRouter, Request

from server import __version__ as VERSION
from server.api.errors import APIError
from server.api.serving_pooling import PoolingContext

router = APIRouter()


def _card(model_id: str, ctx) -> dict:
    """OpenAI's model object, plus kvserve's extensions: the context length (vLLM's
    `max_model_len`), the KV cache (how it is stored and how many tokens the budget holds, every
    sequence's together: /metrics' kvserve_kv_cache_capacity_tokens; what a token takes in every
    layer, an MLA model's latent counted as such, server/engine/mla.py; a hybrid model's recurrent
    state: `CacheManager.recurrent_state`) and whether outputs are
    exact (--deterministic: bit-identical whatever the batch, chunking, reuse or speculation),
    and how the engine runs: kvserve's version, each fast path's state, and `fallbacks` (path:
    why it runs slower than asked; /metrics' kvserve_engine_paths)."""
    manager = ctx.cache_manager
    pool = manager.pool
    kv_cache = {"dtype": manager.config.kv_dtype, "capacity_tokens": manager.capacity_tokens(),
                "bytes_per_token": pool.block_bytes // pool.block_size}
    if (recurrent := manager.recurrent_state()) is not None:  # a hybrid model
        kv_cache["recurrent_state"] = recurrent
    return {
        "id": model_id, "object": "model", "created": 0, "owned_by": "kvserve", "max_model_len": ctx.max_context,
        "kv_cache": kv_cache,
        "deterministic": ctx.engine.config.exact,
        "engine": {"version": VERSION, **ctx.engine_paths},
    }


def _pooling_card(ctx) -> dict:
    """A pooling model's object: its task (vLLM's `task`), context and, for embeddings, the length
    of its vectors."""
    card = {"id": ctx.model_id, "object": "model", "created": 0, "owned_by": "kvserve", "max_model_len": ctx.max_context, "task": ctx.task}
    if ctx.task == "embed":
        card["dimensions"] = ctx.dimensions
    return card


def _adapter_card(adapter, ctx) -> dict:
    """An adapter's model object, as vLLM lists one: `parent` the base model, `root` where its
    weights were read."""
    return {
        "id": adapter.name, "object": "model", "created": 0, "owned_by": "kvserve", "parent": ctx.model_id, "root": adapter.path,
        "max_model_len": ctx.max_context,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    ctx = request.app.state.kv.require_served()
    if isinstance(ctx, PoolingContext):
        return {"object": "list", "data": [_pooling_card(ctx)]}
    adapters = [a for name in ctx.adapters.names if (a := ctx.adapter(name)) is not None] if ctx.adapters is not None else []
    return {"object": "list", "data": [_card(ctx.model_id, ctx), *(_adapter_card(a, ctx) for a in adapters)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    ctx = request.app.state.kv.require_served()
    if isinstance(ctx, PoolingContext):
        ctx.check_model(model_id)
        return _pooling_card(ctx)
    if (adapter := ctx.adapter(model_id)) is not None:
        return _adapter_card(adapter, ctx)
    if model_id != ctx.model_id and model_id not in ctx.model_aliases:
        raise APIError(404, f"The model '{model_id}' does not exist", code="model_not_found", param="model", rejection="bad_request")
    return _card(ctx.model_id, ctx)
