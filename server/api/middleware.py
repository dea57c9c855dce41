"""Pure ASGI middleware: body size limit, API-key auth, HEAD as GET, request metrics.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and the client's
`http.disconnect` message pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable

from server.api.errors import APIError
from server.metrics import Metrics

ANONYMOUS = "anonymous"
PUBLIC_PATHS = frozenset({"/health", "/ready"})


def principal_for(key: str) -> str:
    """A stable principal name for a key that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


async def _send_error(scope, send, error: APIError) -> None:
    status, shaped = error.shaped(scope["path"])
    body = json.dumps(shaped).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Buffers the request body up to `limit()` bytes (read per request: it grows once a
    vision-language model is loaded, `AppState.body_limit`); larger bodies get 413 before any
    parsing."""

    def __init__(self, app, limit: Callable[[], int]) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        max_bytes = self.limit()
        too_large = APIError(413, f"request body larger than {max_bytes} bytes", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await _send_error(scope, send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                return await _send_error(scope, send, too_large)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the client's disconnect

        await self.app(scope, replay, send)


class Auth:
    """API-key auth on every path but /health and /ready: `Authorization: Bearer <key>`, or
    `x-api-key: <key>` (Anthropic's header: its SDKs and Claude Code send it); sets
    `request.state.principal`."""

    def __init__(self, app, keys: list[str], metrics: Metrics) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.metrics = metrics

    def _principal(self, headers: dict[bytes, bytes]) -> str | None:
        # NOTE: the auth scheme is case-insensitive (RFC 9110 11.1): "bearer sk-a" is valid.
        scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() == b"bearer":
            given = given.strip()
        elif b"x-api-key" in headers:
            given = headers[b"x-api-key"].strip()
        else:
            return None
        # NOTE: compare against every key, without stopping early, so timing says nothing
        # about which key (or how much of one) matched.
        matched = None
        for key in self.keys:
            if hmac.compare_digest(given, key):
                matched = key
        return principal_for(matched.decode()) if matched is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if not self.keys or scope["path"] in PUBLIC_PATHS:
            state["principal"] = ANONYMOUS
            return await self.app(scope, receive, send)
        principal = self._principal(dict(scope["headers"]))
        if principal is None:
            self.metrics.rejections.labels("auth").inc()
            return await _send_error(scope, send, APIError(
                401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            ))
        state["principal"] = principal
        await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD answers as GET would, without the body (RFC 9110 9.3.2: GET routes support HEAD).

    NOTE: the route runs as GET, so a HEAD on a POST-only route is a 405 like a GET would be.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # drop the body; the last message ends the response
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class RequestMetrics:
    """Counts HTTP requests by route template (not raw path: bounded label values) and status."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
