"""The Responses API: translate only; the work is in server.api.serving_responses.

The stored-response routes (GET, DELETE, input_items) read the response store only: they
answer while the model is still loading. A response is visible only to the API key that created
it; another key's id is a 404, exactly like an unknown one.
"""

from typing import Annotated

from fastapi import APIRouter, Query, Request

from server.api import serving_responses
from server.api.protocol_responses import InputItemsQuery, ResponsesRequest

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = request.app.state.kv
    return await serving_responses.create(state.require_ctx(), state.responses, body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict:
    return serving_responses.retrieve(request.app.state.kv.responses, request.state.principal, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    state = request.app.state.kv
    return serving_responses.delete(state.ctx, state.responses, request.state.principal, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, query: Annotated[InputItemsQuery, Query()]) -> dict:
    return serving_responses.input_items(request.app.state.kv.responses, request.state.principal, response_id, query)
