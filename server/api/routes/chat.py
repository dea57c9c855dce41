"""POST /v1/chat/completions: translate only; the work is in server.api.serving_chat."""

import logging

from fastapi import APIRouter, Request

from server.api import serving_chat
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest
from server.api.protocol_responses import dropped_tools_header

log = logging.getLogger(__name__)
router = APIRouter()


def drop_hosted_tools(body: ChatCompletionRequest) -> list[str]:
    """Removes the tools kvserve cannot run (any type but `function`, e.g. `custom`) from
    `body.tools`; returns their types. A tool_choice naming such a tool is a 400."""
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type", "function") != "function":
        raise APIError(
            400,
            f"a tool_choice of type {choice.get('type')!r} is not supported: kvserve runs function tools only "
            "(tools of other types are dropped); use 'auto', 'none', 'required' or {'type': 'function', ...}",
            code="invalid_value", param="tool_choice", rejection="bad_request",
        )
    dropped = [str(t["type"]) for t in body.tools or () if t.get("type", "function") != "function"]
    if dropped:
        body.tools = [t for t in body.tools if t.get("type", "function") == "function"] or None
    return dropped


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    headers = dropped_tools_header(drop_hosted_tools(body))
    if headers:
        log.warning("chat completion: dropped tools kvserve cannot run: %s", ", ".join(headers.values()))
    response = await serving_chat.create(request.app.state.kv.require_ctx(), body, request)
    response.headers.update(headers)
    return response
