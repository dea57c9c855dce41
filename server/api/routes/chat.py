"""POST /v1/chat/completions: translate only; the work is in server.api.serving_chat."""

from fastapi import APIRouter, Request

from server.api import serving_chat
from server.api.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await serving_chat.create(request.app.state.kv.require_ctx(), body, request)
