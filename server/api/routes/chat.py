"""POST /v1/chat/completions: translate only; the work is in server.api.serving_chat."""

import logging

from fastapi import APIRouter, Request

from server.api import serving_chat
from server.api.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    headers = body.dropped_tools_header()
    if headers:
        log.warning("chat completion: dropped tools kvserve cannot run: %s", ", ".join(headers.values()))
    response = await serving_chat.create(request.app.state.kv.require_ctx(), body, request)
    response.headers.update(headers)
    return response
