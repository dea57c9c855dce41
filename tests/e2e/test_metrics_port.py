"""/metrics with an API key set: the API port needs the key, the separate --metrics-port does not.

Also the rejection reasons an operator sees there: auth (401) and bad_request (400 invalid body).
"""

from __future__ import annotations

import httpx
import pytest

from bench.common import launch_with_metrics_port
from tests.conftest import test_cache_dir as cache_dir
from tests.device import SERVE_FLAGS
from tests.server.test_api import sample

KEY = "metrics-port-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with launch_with_metrics_port(
        tmp_path_factory.mktemp("server"), "--cache-dir", str(cache_dir()), *SERVE_FLAGS, "--api-key", KEY,
    ) as s:
        yield s


def test_api_port_metrics_need_the_key(server):
    refused = httpx.get(server.url + "/metrics")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    allowed = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200
    assert "kvserve_http_requests_total" in allowed.text


def test_metrics_port_needs_no_key_and_shows_the_same_registry(server):
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    scraped = httpx.get(server.metrics_url)
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'kvserve_info{' in scraped.text and 'model="SmolLM2-135M-Instruct"' in scraped.text
    # The API port's request just above is counted in the registry the metrics port serves.
    assert 'kvserve_http_requests_total{method="GET",route="/metrics",status="200"}' in scraped.text
    assert sample(scraped.text, "kvserve_requests_running") == 0


def test_rejections_by_reason(server):
    def rejected(reason: str) -> float:
        text = httpx.get(server.metrics_url).text
        return sample(text, f'kvserve_request_rejections_total{{reason="{reason}"}}') if f'reason="{reason}"' in text else 0.0

    auth, bad = rejected("auth"), rejected("bad_request")
    assert httpx.get(server.base_url + "/models").status_code == 401
    invalid = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": "SmolLM2-135M-Instruct", "messages": [], "temperature": 9})
    assert invalid.status_code == 400
    assert rejected("auth") == auth + 1
    assert rejected("bad_request") == bad + 1
