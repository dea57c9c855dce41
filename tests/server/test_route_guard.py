"""Every route guarded alike (issue 37): with API keys set, each route of the app, every method,
refuses a missing and a wrong key with 401 in OpenAI's error shape (Anthropic's on the Messages
API's paths), except the documented open
ones (docs/guides/api.md: `/health` and `/ready`; `/metrics` is open only on the separate --metrics-port).

The routes are enumerated from the app itself, so a route added later is checked too: it fails
here if it answers without a key, and an open route the manual does not list fails as well."""

from __future__ import annotations

import re

import pytest
from starlette.routing import Mount

from server.api import errors, middleware
from server.startup import create_app
from server.settings import Settings
from tests.device import SETTINGS
from tests.server.test_api import assert_error_shape
from tests.server.test_messages import assert_anthropic_error

pytestmark = pytest.mark.anyio
KEY = "sk-guard"
OPEN = frozenset({"/health", "/ready"})  # as docs/guides/api.md documents them
API_ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/models"), ("GET", "/metrics"), ("DELETE", "/v1/sessions/{session_id:path}"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"), ("POST", "/v1/score"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")}


def routes(app) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves, HEAD included where GET is;
    a mounted app as one GET below its prefix."""
    out = set()
    for route, path, methods in _flat(app):
        if isinstance(route, Mount):
            out.add(("GET", path + "/x"))
            continue
        out.update((method, path) for method in methods or ())
        if "GET" in (methods or ()):
            out.add(("HEAD", path))
    return sorted(out)


def _flat(app) -> list[tuple[object, str, set | None]]:
    """(route, full path, methods) of each route, included routers opened up."""
    try:  # FastAPI >= 0.165 keeps included routers whole in app.routes
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return [(r, getattr(r, "path", ""), getattr(r, "methods", None)) for r in app.routes]
    return [(c.route, c.path, c.methods) for c in iter_route_contexts(app.routes)]


def concrete(path: str) -> str:
    """A path template with each parameter filled in (`/v1/responses/{response_id}` -> `.../x`)."""
    return re.sub(r"\{[^}]+\}", "x", path)


async def test_every_route_refuses_a_missing_or_wrong_key(app_client):
    served = routes(create_app(Settings(**SETTINGS, api_key=[KEY])))  # the same routes, never started
    async with app_client(api_key=[KEY]) as client:
        assert API_ROUTES <= set(served), f"the enumeration missed routes: {API_ROUTES - set(served)}"
        assert middleware.PUBLIC_PATHS == OPEN, "an open route the manual (docs/guides/api.md) does not document"
        for method, path in served:
            url = concrete(path)
            if path in OPEN:
                answered = await client.request(method, url)
                assert answered.status_code != 401, (method, path)
                continue
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
                refused = await client.request(method, url, headers=headers)
                if method == "HEAD":
                    assert refused.status_code == 401 and not refused.content, (method, path, headers)
                elif errors.anthropic_path(path):
                    assert_anthropic_error(refused, 401, "authentication_error")
                else:
                    assert_error_shape(refused, 401, "invalid_api_key")
                assert refused.headers["www-authenticate"] == "Bearer", (method, path)
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
