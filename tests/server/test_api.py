"""The HTTP API in-process (httpx ASGITransport + lifespan) on the real model."""

import json
import re
from pathlib import Path

import anyio

import pytest

import server

from tests.device import DEVICE, DTYPE_NAME

pytestmark = pytest.mark.anyio
MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


def assert_error_shape(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text and "/site-packages/" not in response.text
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def sample(text: str, name: str) -> float:
    """The value of sample `name` (with its labels, if any) in a /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def sse_payloads(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_health_ready_version_models(app_client):
    async with app_client() as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/ready")).status_code == 200
        assert "version" in (await client.get("/version")).json()
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == MODEL
        assert_error_shape(await client.get("/v1/models/other"), 404, "model_not_found")


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, None),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),  # a text-only model takes no images
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, None),
        ({"presence_penalty": -3}, "presence_penalty"),
    ],
)
async def test_invalid_chat_parameters_are_400_with_param(app_client, patch, param):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **patch}
    async with app_client() as client:
        error = assert_error_shape(await client.post("/v1/chat/completions", json=body), 400)
        if param is not None:
            assert error["param"] == param


async def test_request_level_errors(app_client):
    async with app_client(max_body_bytes=2048) as client:
        assert_error_shape(await client.post("/v1/chat/completions", json={"messages": HELLO}), 400, param="model")
        assert_error_shape(await client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
        assert_error_shape(await client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": HELLO}), 404, "model_not_found", "model")
        assert_error_shape(await client.get("/v1/nothing"), 404, "not_found")
        assert_error_shape(await client.get("/v1/chat/completions"), 405, "method_not_allowed")
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error_shape(await client.post("/v1/chat/completions", json=big), 413, "request_too_large")
        # still serving after all of that
        ok = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
        assert ok.status_code == 200


async def test_context_length_exceeded_names_the_numbers(app_client):
    async with app_client(max_model_len=64) as client:
        long = [{"role": "user", "content": "word " * 100}]
        error = assert_error_shape(await client.post("/v1/chat/completions", json={"model": MODEL, "messages": long}), 400, "context_length_exceeded")
        assert "64" in error["message"]
        fits = [{"role": "user", "content": "hi"}]
        error = assert_error_shape(await client.post("/v1/chat/completions", json={"model": MODEL, "messages": fits, "max_tokens": 60}), 400, "context_length_exceeded", "max_tokens")
        prompt = [1] * 70
        assert_error_shape(await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "context_length_exceeded")


async def test_completions_bad_prompts(app_client):
    async with app_client() as client:
        assert_error_shape(await client.post("/v1/completions", json={"model": MODEL, "prompt": [10**6]}), 400, param="prompt")
        assert_error_shape(await client.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400, param="prompt")
        assert_error_shape(await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", [1, 2]]}), 400)


async def test_auth(app_client):
    async with app_client(api_key=["k-one", "k-two"]) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"}):
            assert_error_shape(await client.get("/v1/models", headers=headers), 401, "invalid_api_key")
            assert_error_shape(await client.get("/metrics", headers=headers), 401, "invalid_api_key")
            assert_error_shape(await client.post("/v1/chat/completions", json={}, headers=headers), 401, "invalid_api_key")
        for key in ("k-one", "k-two"):
            assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
        assert (await client.get("/metrics", headers={"Authorization": "Bearer k-two"})).status_code == 200


async def test_chat_stream_equals_non_stream_and_usage(app_client):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 0, "unknown_field": {"x": 1}}
    async with app_client() as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        assert plain["object"] == "chat.completion"
        assert plain["id"].startswith("chatcmpl-") and plain["system_fingerprint"].startswith("fp_")
        choice = plain["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        usage = plain["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(streamed.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == choice["message"]["content"]
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == choice["finish_reason"]
        streamed_usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        assert {k: v for k, v in streamed_usage.items() if k != "prompt_tokens_details"} == {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
        # the same prompt again, anonymously and without API keys: anonymous reuse is off by
        # default then (every keyless caller shares one principal), so nothing is reused
        assert streamed_usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert streamed.headers["x-cache-reused-tokens"] == "0"
        assert all(c["usage"] is None for c in chunks[:-1])


async def test_n_choices_logprobs_and_completions(app_client, tokenizer):
    async with app_client() as client:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 3}
        out = (await client.post("/v1/chat/completions", json=body)).json()
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert out["choices"][0]["message"] == out["choices"][1]["message"]  # greedy
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"] // 2
        for entry in content:
            assert len(entry["top_logprobs"]) == 3
            assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
            assert bytes(entry["bytes"]).decode("utf-8") == entry["token"]

        prompts = ["The capital of France is", "1, 2, 3,"]
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 2}
        out = (await client.post("/v1/completions", json=body)).json()
        assert out["object"] == "text_completion"
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert out["choices"][0]["text"] == out["choices"][1]["text"] and out["choices"][0]["text"]
        lp = out["choices"][2]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert out["usage"]["prompt_tokens"] == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
        by_ids = {"model": MODEL, "prompt": tokenizer(prompts[0])["input_ids"], "max_tokens": 4, "temperature": 0}
        same = (await client.post("/v1/completions", json=by_ids)).json()
        assert same["choices"][0]["text"] == out["choices"][0]["text"]


async def test_metrics_count_requests_and_tokens(app_client):
    async with app_client() as client:
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0})
        await client.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
        text = (await client.get("/metrics")).text
        assert 'kvserve_http_requests_total{method="POST",route="/v1/chat/completions",status="200"} 1.0' in text
        assert 'kvserve_http_requests_total{method="POST",route="/v1/chat/completions",status="404"} 1.0' in text
        assert "kvserve_generation_tokens_total 3.0" in text
        assert 'kvserve_time_to_first_token_seconds_count{cache="miss"} 1.0' in text
        assert "kvserve_requests_running 0.0" in text and "kvserve_requests_waiting 0.0" in text
        assert f'kvserve_info{{device="{DEVICE.type}",dtype="{DTYPE_NAME}",model="SmolLM2-135M-Instruct"' in text
        # the version, as `kvserve --version` and /v1/models' engine block say it
        build = next(line for line in text.splitlines() if line.startswith("kvserve_build_info{"))
        assert f'version="{server.__version__}"' in build and 'torch="' in build and 'transformers="' in build
        assert (await client.get("/v1/models")).json()["data"][0]["engine"]["version"] == server.__version__


async def test_a_failed_load_is_503_without_paths(tmp_path):
    import httpx
    from asgi_lifespan import LifespanManager

    from server.startup import create_app
    from server.settings import Settings

    app = create_app(Settings(model=str(tmp_path / "missing.gguf"), cache_dir=tmp_path))
    async with LifespanManager(app) as manager:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://kvserve") as client:
            for _ in range(200):
                if app.state.kv.load_error:
                    break
                await anyio.sleep(0.05)
            ready = await client.get("/ready")
            assert ready.status_code == 503 and "failed to load" in ready.text
            assert str(tmp_path) not in ready.text
            assert_error_shape(await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}), 503, "model_unavailable")
            health = await client.get("/health")  # the process cannot serve: `serve` exits with status 4
            assert health.status_code == 503 and str(tmp_path) not in health.text
            assert app.state.kv.exit_status == 4


async def test_every_series_the_dashboard_queries_exists_on_a_default_server(app_client):
    """A server without LoRA adapters, tiers or a draft model still exports every metric family
    the Grafana dashboard queries (gauges at 0, counters and histograms with their HELP and
    TYPE), so no panel reads "no data" for a feature that is off."""
    dashboard = (Path(__file__).parents[2] / "docker" / "grafana" / "dashboards" / "kvserve.json").read_text(encoding="utf-8")
    exprs = [target["expr"] for panel in _panels(json.loads(dashboard)) for target in panel.get("targets", []) if "expr" in target]
    queried = {name for expr in exprs for name in re.findall(r"\b(kvserve_[a-z0-9_]+)", expr)}
    async with app_client() as client:
        text = (await client.get("/metrics")).text
    exported = set(re.findall(r"^# HELP (\S+) ", text, re.M))

    def family(name: str) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name.removesuffix(suffix) in exported:
                return name.removesuffix(suffix)
        return name

    assert len(queried) > 40
    assert {family(n) for n in queried} <= exported, sorted({family(n) for n in queried} - exported)
    assert "kvserve_lora_adapters_loaded 0.0" in text and "kvserve_lora_swaps_total 0.0" in text


def _panels(node) -> list[dict]:
    """Every panel of a dashboard, rows' panels included."""
    panels = []
    for panel in node.get("panels", []):
        panels.append(panel)
        panels += _panels(panel)
    return panels
