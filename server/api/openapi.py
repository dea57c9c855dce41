"""/openapi.json as the server really answers: 400 (not FastAPI's 422) for invalid input, 204 for
DELETE, and every documented non-2xx in OpenAI's error shape (Anthropic's on the Messages API).

One table, `OPERATIONS`, says for each route what it answers besides its success; a route the
table does not know fails the document (and the test that fetches it), so a new route cannot go
undocumented.
"""

from __future__ import annotations

from typing import NamedTuple

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string", "minLength": 1}},
        },
    },
}
ERRORS = {
    400: "Invalid request; `param` names the offending field",
    401: "Missing or wrong API key (only when the server has keys)",
    404: "No such model, session or stored response",
    409: "The session has a request in flight, or (a LoRA load) the name is already served",
    413: "Request body too large",
    415: "Content-Type is not application/json",
    429: "Queue full; retry after `Retry-After` seconds",
    503: "Model loading or server shutting down",
    504: "The request ran past its deadline",
    507: "No room for another LoRA adapter (--max-cpu-loras, or host memory)",
    529: "Overloaded (Messages API): queue full, model loading or server shutting down; retry after `Retry-After` seconds",
}
_GENERATION = (400, 401, 404, 409, 413, 415, 429, 503, 504)
_MESSAGES = (400, 401, 404, 409, 413, 415, 504, 529)  # Anthropic's statuses: 529 for 429 queue_full and 503


class Operation(NamedTuple):
    """What one route answers: its success status and media types, and its error statuses."""

    errors: tuple[int, ...]
    success: int = 200
    media: tuple[str, ...] = ("application/json",)
    anthropic: bool = False  # errors in Anthropic's shape


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", "/health"): Operation(()),
    ("get", "/ready"): Operation((503,)),
    ("get", "/version"): Operation((401,)),
    ("get", "/metrics"): Operation((401,), media=("text/plain",)),
    ("get", "/v1/models"): Operation((401, 503)),
    ("get", "/v1/models/{model_id}"): Operation((401, 404, 503)),
    ("post", "/v1/chat/completions"): Operation(_GENERATION, media=("application/json", "text/event-stream")),
    ("post", "/v1/completions"): Operation(_GENERATION, media=("application/json", "text/event-stream")),
    ("post", "/v1/responses"): Operation(_GENERATION, media=("application/json", "text/event-stream")),
    ("get", "/v1/responses/{response_id}"): Operation((401, 404)),
    ("delete", "/v1/responses/{response_id}"): Operation((401, 404)),
    ("get", "/v1/responses/{response_id}/input_items"): Operation((400, 401, 404)),
    ("post", "/v1/messages"): Operation(_MESSAGES, media=("application/json", "text/event-stream"), anthropic=True),
    ("post", "/v1/messages/count_tokens"): Operation((400, 401, 404, 413, 415, 529), anthropic=True),
    ("get", "/v1/sessions"): Operation((401, 503)),
    ("delete", "/v1/sessions/{session_id}"): Operation((401, 404, 409, 503), success=204, media=()),
    ("post", "/tokenize"): Operation((400, 401, 404, 413, 415, 503)),
    ("post", "/detokenize"): Operation((400, 401, 404, 413, 415, 503)),
    # the pooling tasks (--task embed, rerank); a 400 `task_not_served` on a server of another task
    ("post", "/v1/embeddings"): Operation((400, 401, 404, 413, 415, 429, 503, 504)),
    ("post", "/v1/rerank"): Operation((400, 401, 404, 413, 415, 429, 503, 504)),
    ("post", "/v1/score"): Operation((400, 401, 404, 413, 415, 429, 503, 504)),
    ("get", "/server_info"): Operation((401, 503)),
    ("get", "/v1/loads"): Operation((400, 401, 503)),
    ("get", "/loads"): Operation((400, 401, 404, 503)),
    # only with --enable-lora-loading (server/api/routes/lora_admin.py)
    ("post", "/v1/load_lora_adapter"): Operation((400, 401, 409, 503, 507), media=("text/plain",)),
    ("post", "/v1/unload_lora_adapter"): Operation((400, 401, 404, 503), media=("text/plain",)),
}


# NOTE: one server-sent event, as SSE readers (schemathesis among them) hand it over: its data
# alone, or its fields when it has more than data (the Responses API names every event).
SSE_EVENT = {"anyOf": [
    {"type": "string"},
    {"type": "object", "required": ["data"],
     "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}},
]}


def describe(operation: dict, spec: Operation) -> None:
    """Replaces FastAPI's guessed responses of one operation with what the server sends."""
    generated = operation.get("responses", {}).get("200", {}).get("content", {}).get("application/json", {})
    schemas = {"application/json": generated, "text/event-stream": {"schema": SSE_EVENT}}
    content = {media: schemas.get(media, {"schema": {"type": "string"}}) for media in spec.media}
    success = {"description": "Success"} | ({"content": content} if content else {})
    operation["responses"] = {str(spec.success): success} | {
        str(status): {"description": ERRORS[status], "content": {"application/json": {"schema": ANTHROPIC_ERROR_REF if spec.anthropic else ERROR_REF}}}
        for status in spec.errors
    }


def document(app: FastAPI) -> dict:
    """The OpenAPI document of `app`; raises if a route is missing from `OPERATIONS`."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            spec = OPERATIONS.get((method, path))
            if spec is None:
                raise KeyError(f"{method.upper()} {path} is not described in server.api.openapi.OPERATIONS")
            describe(operation, spec)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    schemas["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serves `document(app)` at /openapi.json (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi
