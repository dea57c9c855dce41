"""Property-based conformance: schemathesis generates requests from /openapi.json and checks every
answer against the same document (status codes, content types, response schemas) on the real
app and model, in-process over ASGI.

Bounded for 2 CPU cores: a few examples per operation, the served model's name, at most one
choice of at most two tokens per request (generation costs ~40 ms a token).
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.startup import create_app
from server.api.errors import anthropic_path
from server.api.openapi import OPERATIONS
from server.api.routes import lora_admin
from server.model_loader import load_model
from server.settings import Settings
from tests.server.test_api import MODEL, assert_error_shape
from tests.server.test_messages import assert_anthropic_error

MAX_TOKENS = 2
MAX_EXAMPLES = 25
# NOTE: schemathesis' default is 10 s; a two-token generation can take longer on a shared,
# saturated 2-core box, which made a valid case fail as a flaky timeout.
REQUEST_TIMEOUT_S = 60
CHECKS = [schemathesis.checks.not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


# the run-time LoRA routes, served only with --enable-lora-loading (`lora_api_schema`)
LORA_ROUTES = frozenset((method.lower(), route.path) for route in lora_admin.router.routes for method in route.methods)


@pytest.fixture
def api_schema(smollm2):
    """The real app's own OpenAPI document, its lifespan started by schemathesis' ASGI client;
    waits until the model is ready and shuts the lifespan down afterwards.

    NOTE: one app per test: schemathesis' pytest plugin ends every ASGI lifespan at each test's
    teardown.
    """
    yield from schema_of(create_app(Settings(grammar_compile_timeout_s=1.0), loaded=smollm2))


@pytest.fixture(scope="module")
def lora_model():
    """A SmolLM2 of its own: the run-time LoRA layout wraps its linear layers for good."""
    from tests.conftest import test_cache_dir
    from tests.device import DEVICE, DTYPE_NAME

    return load_model(None, cache_dir=test_cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME)


@pytest.fixture
def lora_api_schema(lora_model, tmp_path):
    """`api_schema` of a server with --enable-lora-loading (an empty --lora-dir: every load is
    refused, as documented)."""
    settings = Settings(grammar_compile_timeout_s=1.0, enable_lora_loading=True, lora_dir=tmp_path, max_loras=1, max_lora_rank=8)
    yield from schema_of(create_app(settings, loaded=lora_model))


# the pooling tasks' routes, fuzzed on a server of their task (`pooling_schema`); a generating
# server answers them with a 400 (fuzzed by `test_api_conforms_to_its_openapi_document` too)
POOLING_ROUTES = [("bert-mean", "/v1/embeddings"), ("bert-reranker", "/v1/rerank"), ("bert-reranker", "/v1/score")]


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory):
    """Tiny random-weight checkpoints (bench/embeddings.py) loaded for their task (auto)."""
    from bench.embeddings import save
    from tests.conftest import test_cache_dir
    from tests.device import DEVICE, DTYPE_NAME

    root = tmp_path_factory.mktemp("pooling")
    return {kind: load_model(str(save(kind, root / kind)), cache_dir=test_cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME, task="auto")
            for kind in ("bert-mean", "bert-reranker")}


@pytest.fixture
def pooling_schema(pooling_models, request):
    """`api_schema` of a server of a pooling task, serving `request.param` under the name the
    generated bodies carry."""
    yield from schema_of(create_app(Settings(served_model_name=MODEL), loaded=pooling_models[request.param]))


def schema_of(app):
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    deadline = time.monotonic() + 60
    while not app.state.kv.ready:
        assert time.monotonic() < deadline, "app never became ready"
        time.sleep(0.05)
    yield loaded
    shutdown_lifespans()


def bounded(body):
    """The generated body with the served model and a short, single-choice generation (each
    API ignores the other's length field)."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    return body | {"model": MODEL, "max_tokens": MAX_TOKENS, "max_output_tokens": MAX_TOKENS, "n": 1}


def check(case) -> None:
    """No 5xx, every answer as documented, and every non-2xx in OpenAI's error shape (Anthropic's
    on the Messages API)."""
    if case.method == "POST":
        case.body = bounded(case.body)
    response = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
    if response.status_code >= 400:
        if anthropic_path(case.path):
            assert_anthropic_error(response, response.status_code)
        else:
            assert_error_shape(response, response.status_code)


# NOTE: operations come from our own table rather than schemathesis' pytest plugin
# (`from_fixture(...).parametrize()` fails on pytest 9: it reads the removed `Function._nodeid`).
@pytest.mark.parametrize("method, path", sorted(set(OPERATIONS) - LORA_ROUTES))
def test_api_conforms_to_its_openapi_document(api_schema, method, path):
    conforms(api_schema[path][method.upper()])


@pytest.mark.parametrize("method, path", sorted(LORA_ROUTES))
def test_the_run_time_lora_routes_conform_to_the_document(lora_api_schema, method, path):
    conforms(lora_api_schema[path][method.upper()])


def conforms(operation) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        check(case)

    run()


@pytest.mark.parametrize("pooling_schema, path", POOLING_ROUTES, indirect=["pooling_schema"])
def test_the_pooling_routes_conform_on_a_server_of_their_task(pooling_schema, path):
    conforms(pooling_schema[path]["POST"])


STREAMED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Hi"},
    "/v1/responses": {"input": "Hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.mark.parametrize("path", sorted(STREAMED))
def test_streamed_answers_conform_to_the_document(api_schema, path):
    """Every route that streams, streaming for sure (generated bodies stream only by chance):
    each server-sent event conforms, named ones (the Responses API's) included."""
    case = api_schema[path]["POST"].Case(body={"model": MODEL, "stream": True, **STREAMED[path]}, media_type="application/json")
    check(case)
