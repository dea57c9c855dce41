"""POST /v1/embeddings (OpenAI's): translate only; the work is in server.api.serving_pooling."""

from fastapi import APIRouter, Request

from server.api import serving_pooling
from server.api.protocol_pooling import EmbeddingRequest, EmbeddingResponse

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    return await serving_pooling.embed(request.app.state.kv.require_pooling("embed", "/v1/embeddings"), body, request)
