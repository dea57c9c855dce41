"""What a router in front of the replicas asks a worker besides the OpenAI API: SGLang's
`/server_info` and load report (`/v1/loads`, also at `/loads`), in the shapes Shepherd Model
Gateway (SMG, formerly SGLang's router) reads.

SMG 1.13 reads /server_info when it registers a replica (kvserve stays a vLLM runtime to it,
since kvserve answers /version too), then polls each replica's load from the first of
/loads, /v1/loads and /metrics that answers: /loads, every --load-monitor-interval seconds.
cache_aware routes on it: a prompt no replica holds goes to the least loaded replica, and a
replica whose `token_usage` reaches --worker-overload-token-usage (0.8) is skipped while
another is under it.

Counts are the engine's own, as /metrics has them (`kvserve_requests_running`,
`kvserve_requests_waiting`). `token_usage` is the share of the KV budget that requests in
flight hold; idle sessions' caches are left out, since the cache manager evicts them for new
work on demand (SGLang leaves its evictable prefix cache out of `token_usage`, vLLM counts
cached free blocks as free), so a replica full of idle sessions does not look overloaded.
kvserve budgets KV in bytes, not token slots, so SGLang's token counts (`num_used_tokens`,
`max_total_num_tokens`) are left out, as SGLang leaves out what it does not measure.
"""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from prometheus_client import Gauge
from pydantic import BaseModel

from server import __version__
from server.api.errors import APIError
from server.api.serving import ServingContext

router = APIRouter()

# SGLang's `include` sections of /v1/loads; kvserve fills `core` and `queues`.
SECTIONS = frozenset({"all", "core", "memory", "spec", "lora", "disagg", "queues"})


class ServerInfo(BaseModel):
    """SGLang's /server_info fields that describe a kvserve replica (one model copy, one device)."""

    served_model_name: str
    context_length: int
    max_running_requests: int
    max_queued_requests: int
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    is_embedding: bool = False
    disaggregation_mode: str = "null"
    version: str = __version__


class Queues(BaseModel):
    waiting: int
    grammar: int = 0  # grammars compile before a request is queued
    paused: int = 0
    retracted: int = 0


class RankLoad(BaseModel):
    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    token_usage: float  # 0-1: KV held by requests in flight / the KV budget
    max_running_requests: int
    queues: Queues | None = None


class Aggregate(BaseModel):
    total_running_reqs: int
    total_waiting_reqs: int
    total_reqs: int
    avg_token_usage: float


class Loads(BaseModel):
    timestamp: str
    version: str = __version__
    dp_rank_count: int = 1
    loads: list[RankLoad]
    aggregate: Aggregate


def _gauge(gauge: Gauge) -> int:
    return int(gauge.collect()[0].samples[0].value)


def in_flight_kv_share(ctx: ServingContext) -> float:
    """Bytes of KV that requests in flight hold (their sessions' caches and private ones) over
    the device budget; idle sessions, evictable on demand, are left out."""
    cache = ctx.cache_manager
    used, budget, _ = cache.tier_usage()["device"]
    idle = sum(e.nbytes for e in cache.store.entries() if e.idle)
    return min(max(used - idle, 0) / budget, 1.0) if budget > 0 else 0.0


def load_report(ctx: ServingContext, sections: set[str]) -> Loads:
    running, waiting = _gauge(ctx.metrics.requests_running), _gauge(ctx.metrics.requests_waiting)
    usage = round(in_flight_kv_share(ctx), 6)
    rank = RankLoad(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        token_usage=usage,
        max_running_requests=ctx.engine.config.max_running,
        queues=Queues(waiting=waiting) if sections & {"all", "queues"} else None,
    )
    return Loads(
        timestamp=datetime.now(timezone.utc).isoformat(),
        loads=[rank],
        aggregate=Aggregate(total_running_reqs=running, total_waiting_reqs=waiting, total_reqs=running + waiting, avg_token_usage=usage),
    )


def _sections(include: str | None) -> set[str]:
    sections = {s.strip() for s in (include or "all").split(",") if s.strip()} or {"all"}
    if unknown := sections - SECTIONS:
        raise APIError(400, f"include: unknown sections {sorted(unknown)}; known: {sorted(SECTIONS)}",
                       code="invalid_value", param="include")
    return sections


@router.get("/server_info")
async def server_info(request: Request) -> ServerInfo:
    ctx = request.app.state.kv.require_ctx()
    config = ctx.engine.config
    return ServerInfo(
        served_model_name=ctx.model_id,
        context_length=ctx.max_context,
        max_running_requests=config.max_running,
        max_queued_requests=config.max_queue,
    )


@router.get("/v1/loads", response_model_exclude_none=True)
async def loads(request: Request, include: str | None = None, dp_rank: str | None = None) -> Loads:
    """Requests running and waiting, and the KV budget's share held by requests in flight.
    `include`: SGLang's comma-separated sections; `dp_rank`: 0, kvserve's only rank."""
    ctx = request.app.state.kv.require_ctx()
    sections = _sections(include)
    if dp_rank not in (None, "0"):
        raise APIError(400, f"dp_rank: no rank {dp_rank!r}; kvserve has one rank, 0", code="invalid_value", param="dp_rank")
    return load_report(ctx, sections)


@router.get("/loads", response_model_exclude_none=True)
async def loads_of_model(request: Request, model: str | None = None, include: str | None = None) -> Loads:
    """/v1/loads for one model (`model`: the served model or an alias)."""
    ctx = request.app.state.kv.require_ctx()
    if model is not None:
        ctx.check_model(model)
    return load_report(ctx, _sections(include))
