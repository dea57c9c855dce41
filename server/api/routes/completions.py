"""POST /v1/completions: translate only; the work is in server.api.serving_completions."""

from fastapi import APIRouter, Request

from server.api import serving_completions
from server.api.protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    return await serving_completions.create(request.app.state.kv.require_ctx(), body, request)
