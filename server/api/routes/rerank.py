"""POST /v1/rerank (the Cohere/Jina shape) and /v1/score (vLLM's): translate only; the work is in
server.api.serving_pooling."""

from fastapi import APIRouter, Request

from server.api import serving_pooling
from server.api.protocol_pooling import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse

router = APIRouter()


@router.post("/v1/rerank", response_model_exclude_none=True)
async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
    return await serving_pooling.rerank(request.app.state.kv.require_pooling("rerank", "/v1/rerank"), body, request)


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    return await serving_pooling.score(request.app.state.kv.require_pooling("rerank", "/v1/score"), body, request)
