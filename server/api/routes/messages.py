"""Anthropic's Messages API: translate only; the work is in server.api.serving_messages. The
`anthropic-version` and `anthropic-beta` headers are accepted (one version is served); errors
on these paths are in Anthropic's shape (server/api/errors.py)."""

from fastapi import APIRouter, Request

from server.api import serving_messages
from server.api.protocol_messages import CountTokensRequest, MessagesRequest

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    return await serving_messages.create(request.app.state.kv.require_ctx(), body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    return await serving_messages.count_tokens(request.app.state.kv.require_ctx(), body, request)
