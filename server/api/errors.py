"""OpenAI-shaped errors: every non-2xx response is `{"error": {message, type, param, code}}`;
Anthropic-shaped on the Messages API's paths (`{"type": "error", "error": {type, message}}`,
`anthropic_path`), where an overloaded server answers 529 `overloaded_error` as Anthropic's does.

Handlers are installed on the app for our own `APIError`, FastAPI's validation errors, Starlette's
HTTP exceptions (404/405 of unknown routes) and anything unexpected (500 without details: no
stack traces or file paths leave the process).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
    507: "insufficient_storage_error",
}


# Anthropic's error types by status (its API reference, "Errors"); 529: the server is overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """The path is the Messages API's (`/v1/messages`, `/v1/messages/count_tokens`): its errors
    are in Anthropic's shape."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    """An error the client should see as-is, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        rejection: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers
        self.rejection = rejection  # the rejections-counter reason: a refusal before generation

    def body(self) -> dict:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    @property
    def anthropic_status(self) -> int:
        """The status Anthropic's API would answer: 529 for a server that cannot take the
        request now (queue full, loading, shutting down), else the same."""
        return OVERLOADED if self.status == 503 or self.code == "queue_full" else self.status

    def anthropic_body(self) -> dict:
        status = self.anthropic_status
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def shaped(self, path: str) -> tuple[int, dict]:
        """(status, body) in the shape of the API `path` belongs to."""
        if anthropic_path(path):
            return self.anthropic_status, self.anthropic_body()
        return self.status, self.body()

    def response(self, path: str = "") -> JSONResponse:
        status, body = self.shaped(path)
        return JSONResponse(body, status_code=status, headers=self.headers)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; ('query', 'limit') -> 'limit'.
    Only the first element says where the field is: a body field may be named `query` (rerank's)."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path") else list(loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _BRANCH_NAMES or not str(part).isidentifier():
            continue  # pydantic's union-branch names ("constrained-str", "list[TextPart]")
        else:
            out += f".{part}" if out else str(part)
    return out or None


_OBJECT_TYPES = frozenset({"model_type", "model_attributes_type", "dict_type"})
# Validation errors raised with OpenAI's own code as their type (PydanticCustomError): the
# message is OpenAI's, already naming the field, and the code is passed on as it is.
_OPENAI_CODES = frozenset({"empty_array"})
UNPARSEABLE = "We could not parse the JSON body of your request"
BODY_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's HTTPException detail
_NOT_AN_OBJECT = _OBJECT_TYPES | {"missing"}


def _is_json(content_type: str | None) -> bool:
    """FastAPI parses a body as JSON when the type is absent, application/json or +json."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def body_error(exc: RequestValidationError, headers) -> APIError | None:
    """The error for a body that is not a JSON object at all (empty, `null`, a list, text/plain),
    said in words instead of pydantic's "'None' is a required property"; None otherwise."""
    root = [e for e in exc.errors() if tuple(e.get("loc", ())) == ("body",) and e.get("type") in _NOT_AN_OBJECT]
    if not root:
        return None
    content_type = headers.get("content-type")
    if not _is_json(content_type):
        return APIError(415, f"Content-Type must be application/json, got {content_type!r}", code="unsupported_media_type")
    if root[0].get("type") == "missing" and headers.get("content-length", "0") == "0":
        return APIError(400, "request body is empty: send a JSON object", code="invalid_request")
    return APIError(400, "request body must be a JSON object", code="invalid_request")


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # NOTE: a union field reports one error per branch; the deepest one is the informative one
    # (an image part fails deep inside the list-of-parts branch, not at "is it a string").
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"})
    param = _param_path(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        where = f" at character {loc[-1]}" if len(loc) > 1 and isinstance(loc[-1], int) else ""
        error = (first.get("ctx") or {}).get("error", "not valid JSON")
        message, param = f"{UNPARSEABLE}: {error}{where}. The API expects a JSON object.", None
    elif first.get("type") in _OPENAI_CODES:
        return APIError(400, message, code=first["type"], param=param)
    elif first.get("type") == "missing":
        message = f"'{param}' is a required property"
    elif first.get("type") in _OBJECT_TYPES and param:
        message = f"{param}: must be a JSON object"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, code="invalid_value" if param else "invalid_request", param=param)


def unparseable_body(cause: Exception) -> APIError:
    """A JSON body the parser gave up on: OpenAI's words and type (OpenAI itself sends `code:
    null` here; kvserve's code is the one it gives any body that is not a JSON object)."""
    why = "it nests too deeply (at most about 1000 levels)" if isinstance(cause, RecursionError) else "it could not be decoded"
    return APIError(400, f"{UNPARSEABLE}: {why}. The API expects a JSON object.", code="invalid_request")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state = getattr(request.app.state, "kv", None)  # server.api.app.AppState
        if exc.rejection is not None and state is not None:
            state.metrics.rejections.labels(exc.rejection).inc()
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        state = getattr(request.app.state, "kv", None)  # server.api.app.AppState
        if state is not None:
            state.metrics.rejections.labels("bad_request").inc()
        return (body_error(exc, request.headers) or validation_error(exc)).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == BODY_PARSE_ERROR and isinstance(exc.__cause__, Exception):
            # NOTE: FastAPI's 400 for a body its JSON parser raised on other than a syntax
            # error: nesting deeper than Python's recursion limit (~1000 levels), bytes that
            # are not UTF-8.
            state = getattr(request.app.state, "kv", None)
            if state is not None:
                state.metrics.rejections.labels("bad_request").inc()
            return unparseable_body(exc.__cause__).response(request.url.path)
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return APIError(
            exc.status_code,
            message.get(exc.status_code, str(exc.detail)),
            code=codes.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error"),
            headers=getattr(exc, "headers", None),
        ).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error", code="internal_error").response(request.url.path)
