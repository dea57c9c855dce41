"""POST /v1/chat/completions: translate only; the work is in server.serving_chat."""

from fastapi import APIRouter, Request

from server import serving_chat
from server.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await serving_chat.create(request.app.state.kv.require_ctx(), body, request)
