"""The Grafana dashboard against a real Prometheus scraping a live kvserve.

A `prometheus` binary (Debian package `prometheus`; `scripts/install.sh test` installs it) scrapes
the separate metrics port of a real `kvserve serve` every second, as docker/prometheus.yml does.
Real traffic through the openai SDK makes every labelled series appear (a session over two turns
for cache hits and a grow, a stream, rejected requests, a deleted session, a session restored
from the disk KV tier that an earlier process wrote at SIGTERM, requests on two LoRA adapters
sharing one device slot, a run-time adapter load and unload), in two rounds a few scrapes apart
so that every rate has an increase to see. Then every PromQL expression of
docker/grafana/dashboards/kvserve.json goes through Prometheus' /api/v1/query and must return
data.

Grafana's variables are replaced before evaluation (`GRAFANA_VARIABLES`): `$__rate_interval` by
`1m` (in Grafana at least four scrape intervals; one minute spans both rounds of traffic here),
`$__range` by `10m` (longer than the test), and the `$job` / `$instance` selectors by `.*` (All).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from bench.common import free_port, launch, launch_with_metrics_port
from server.engine.core import STEP_LAUNCHES
from server.metrics import Metrics
from server.api.response_store import ResponseStore
from tests.conftest import test_cache_dir as cache_dir
from tests.device import SERVE_FLAGS

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docker/grafana/dashboards/kvserve.json"
MODEL = "SmolLM2-135M-Instruct"
KEY = "prometheus-test-key"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "10m", "$job": ".*", "$instance": ".*"}
PROMETHEUS = shutil.which("prometheus")
IN_CI = os.environ.get("CI", "").lower() == "true"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    out = []
    for panel in dashboard()["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                out.append((inner["title"], target["expr"]))
    return out


def concrete(expr: str) -> str:
    # Longest names first: `$__range` must not eat the start of a longer variable.
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def exposed_names() -> set[str]:
    """Every sample name kvserve's registry can expose (counters get `_total`, etc.)."""
    metrics = Metrics()
    metrics.watch_grammar_cache(SimpleNamespace(hits=0, misses=0, evictions=0, nbytes=0))  # as build_context does
    metrics.watch_tiers(SimpleNamespace(tier_usage=lambda: {t: (0, 0, 0) for t in ("device", "host", "disk")}))
    metrics.watch_response_store(ResponseStore(0))  # as create_app does
    metrics.watch_engine(SimpleNamespace(steps=dict.fromkeys(STEP_LAUNCHES, 0)))  # as build_context does
    metrics.watch_adapters(SimpleNamespace(names=[], slots=[], swaps=0, nbytes=0, host_bytes=0))  # with --lora
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"], "info": ["_info"]}
    return {family.name + s for family in metrics.registry.collect() for s in suffixes[family.type]}


# -- the dashboard file, no Prometheus needed -----------------------------------------------------

def test_dashboard_is_grafana_json_on_the_prometheus_datasource() -> None:
    board = dashboard()
    assert board["uid"] == "kvserve" and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["w"] > 0 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus" and target["expr"].strip()
    for variable in board["templating"]["list"]:
        assert variable["datasource"]["uid"] == "prometheus"
        assert "$" + variable["name"] in GRAFANA_VARIABLES


def test_dashboard_queries_only_metrics_kvserve_exposes() -> None:
    exposed = exposed_names()
    for title, expr in queries():
        used = set(re.findall(r"\bkvserve_[a-z0-9_]+", expr))
        assert used and used <= exposed, f"{title}: {sorted(used - exposed)} are not kvserve metrics"


def test_dashboard_answers_the_operators_questions() -> None:
    titles = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert titles == ["Traffic and latency", "Is the queue growing?", "Batching: is the GPU kept busy?",
                      "Is reuse working?", "Are sessions being evicted?", "Structured output", "Speculative decoding",
                      "Where do sessions live?", "Stored responses (/v1/responses)", "Engine health", "LoRA adapters",
                      "Tensor parallel"]
    exprs = "\n".join(expr for _, expr in queries())
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(kvserve_{metric}_bucket" in exprs
    assert "sum by (le, cache) (rate(kvserve_time_to_first_token_seconds_bucket" in exprs
    for metric in ("batch_rows", "batch_tokens", "engine_step_seconds"):
        assert f"histogram_quantile(0.99, sum by (le) (rate(kvserve_{metric}_bucket" in exprs
    for metric in ("batch_rows", "batch_tokens"):  # mean rows and tokens per step
        assert re.search(rf"rate\(kvserve_{metric}_sum[^)]*\)\) / sum\(rate\(kvserve_{metric}_count", exprs)
    assert "sum(rate(kvserve_engine_step_seconds_count" in exprs  # steps / s
    # the overlap: steps by launch, and the share launched ahead
    assert "sum by (launch) (rate(kvserve_engine_steps_total" in exprs
    assert re.search(r'launch="ahead"\}\[[^]]*\]\)\) / sum\(rate\(kvserve_engine_steps_total', exprs)
    assert re.search(r"rate\(kvserve_prefix_cache_hits_tokens_total[^)]*\)\) / sum\(rate\(kvserve_prefix_cache_queries_tokens_total", exprs)
    assert "sum by (reason) (rate(kvserve_session_evictions_total" in exprs
    # KV capacity and use in tokens (--kv-cache-dtype changes the tokens a budget holds)
    assert "sum(kvserve_kv_cache_capacity_tokens{" in exprs and "sum(kvserve_kv_cache_tokens_used{" in exprs
    assert re.search(r"kvserve_kv_cache_tokens_used\{[^}]*\} / kvserve_kv_cache_capacity_tokens", exprs)
    assert "sum by (reason) (rate(kvserve_prefix_cache_misses_total" in exprs
    assert "histogram_quantile(0.9, sum by (le) (rate(kvserve_grammar_compile_seconds_bucket" in exprs
    assert 'reason="bad_schema"' in exprs
    assert re.search(r"rate\(kvserve_spec_decode_accepted_tokens_total[^)]*\)\) / sum\(rate\(kvserve_spec_decode_draft_tokens_total", exprs)
    assert "histogram_quantile(0.5, sum by (le) (rate(kvserve_spec_decode_acceptance_rate_bucket" in exprs
    assert re.search(r"rate\(kvserve_spec_decode_tokens_per_forward_sum[^)]*\)\) / sum\(rate\(kvserve_spec_decode_tokens_per_forward_count", exprs)
    for metric in ("kv_tier_sessions", "kv_tier_bytes", "kv_tier_budget_bytes"):
        assert f"sum by (tier) (kvserve_{metric}{{" in exprs
    for metric in ("kv_demotions_total", "kv_restores_total"):
        assert f"sum by (tier) (rate(kvserve_{metric}{{" in exprs
    for q in ("0.5", "0.95"):
        assert f"histogram_quantile({q}, sum by (le, tier) (rate(kvserve_kv_restore_seconds_bucket" in exprs
    assert "sum by (tier, reason) (rate(kvserve_kv_restore_failures_total" in exprs
    assert "sum by (result) (rate(kvserve_kv_disk_writes_total" in exprs
    assert 'reason=~"restore_failed|recompute_faster"' in exprs
    for metric in ("lora_requests_total", "lora_generation_tokens_total"):
        assert f"sum by (adapter) (rate(kvserve_{metric}{{" in exprs
    for metric in ("lora_adapters_loaded", "lora_adapters_resident", "lora_slots"):
        assert f"sum(kvserve_{metric}{{" in exprs
    assert "sum(rate(kvserve_lora_swaps_total{" in exprs
    assert "sum by (action, result) (increase(kvserve_lora_loads_total{" in exprs
    assert "max by (rank) (kvserve_rank_step_seconds{" in exprs and "max by (rank, kind) (kvserve_rank_memory_bytes{" in exprs


# -- a real Prometheus ---------------------------------------------------------------------------

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not IN_CI,
    reason="no prometheus binary (apt-get install prometheus, or scripts/install.sh test as root)",
)


RESTORED_TURN = [{"role": "user", "content": "Name three animals."}]
ADAPTERS = ("sql", "poet")  # served from the start (--lora); `extra` is loaded at run time


def write_adapter(path: Path, seed: int, rank: int = 4) -> None:
    """A PEFT LoRA adapter of MODEL on the first two layers' q_proj (576 -> 576), A and B
    random and small: the server reads and serves it like a trained one."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, 576, generator=generator) * 0.01
        tensors[f"{stem}.lora_B.weight"] = torch.randn(576, rank, generator=generator) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))


@pytest.fixture(scope="module")
def kvserve(tmp_path_factory):
    """API key on, metrics on a separate unauthenticated port, like docker/compose.yaml;
    prompt lookup on, so the speculative decoding panels have data; a disk KV tier holding two
    sessions (`restored-1`, `restored-2`) that an earlier process wrote at SIGTERM, so the KV
    tier panels have restores to show; the LoRA adapters `ADAPTERS` on one device slot, and
    run-time loading from the directory holding them and `extra`."""
    work = tmp_path_factory.mktemp("kvserve")
    for seed, name in enumerate((*ADAPTERS, "extra")):
        write_adapter(work / "adapters" / name, seed)
    flags = ("--cache-dir", str(cache_dir()), *SERVE_FLAGS, "--api-key", KEY, "--speculative", "ngram",
             "--kv-disk-dir", str(work / "kv"), "--kv-persist-interval-s", "1",
             *(f for name in ADAPTERS for f in ("--lora", f"{name}={work / 'adapters' / name}")),
             "--max-loras", "1", "--max-lora-rank", "8", "--enable-lora-loading", "--lora-dir", str(work / "adapters"))
    with launch(work, *flags) as earlier:
        client = OpenAI(base_url=earlier.base_url, api_key=KEY, max_retries=0, timeout=120)
        for round_ in (1, 2):
            client.chat.completions.create(model=MODEL, messages=RESTORED_TURN, max_tokens=4, temperature=0,
                                           prompt_cache_key=f"restored-{round_}")
    assert earlier.proc.returncode == 0, earlier.log()[-4000:]
    assert len(list((work / "kv").glob("*.kv"))) == 2  # both sessions written
    with launch_with_metrics_port(work, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(kvserve, tmp_path_factory):
    """A real Prometheus on 127.0.0.1 scraping kvserve's metrics port every second."""
    assert PROMETHEUS, "prometheus is not installed: scripts/install.sh test installs it (Debian package)"
    work = tmp_path_factory.mktemp("prometheus")
    metrics_target = kvserve.metrics_url.removeprefix("http://").removesuffix("/metrics")
    config = work / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvserve\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{metrics_target}']\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=work,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited:\n{log_path.read_text()}"
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log_path.read_text()}"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_for_target_up(prometheus: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        targets = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if [(t["labels"]["job"], t["health"]) for t in targets] == [("kvserve", "up")]:
            return
        assert time.monotonic() < deadline, f"kvserve's metrics port never scraped: {targets}"
        time.sleep(0.2)


def requests_seen_by_kvserve(kvserve) -> float:
    text = httpx.get(kvserve.metrics_url, timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvserve_http_requests_total{"))


def wait_for_scrape(prometheus: str, kvserve) -> None:
    """Until Prometheus holds kvserve's latest request count, plus two more scrapes."""
    want = requests_seen_by_kvserve(kvserve)
    deadline = time.monotonic() + 60
    while True:
        result = query(prometheus, "sum(kvserve_http_requests_total)")
        if result and float(result[0]["value"][1]) >= want:
            break
        assert time.monotonic() < deadline, f"Prometheus never scraped {want} requests: {result}"
        time.sleep(0.5)
    time.sleep(2.5)


LONG_TURN = "Now sort this list, please: " + ", ".join(f"item {i}" for i in range(60))


def send_traffic(kvserve, round_: int) -> None:
    """Each labelled series the dashboard reads: a restore from the disk tier, hits and misses,
    a grow, a stream, a structured request (compiled, then from the grammar cache), rejections,
    a deleted session, requests on both adapters (each swaps the other out of the one slot), a
    run-time load, a refused one and an unload."""
    client = OpenAI(base_url=kvserve.base_url, api_key=KEY, max_retries=0, timeout=120)
    # A session the earlier process wrote to the disk tier: its KV comes back from the file. (In
    # round 2, with restore and prefill speeds measured, recomputing may be judged faster.)
    restored = client.chat.completions.create(model=MODEL, messages=RESTORED_TURN, max_tokens=4, temperature=0,
                                              prompt_cache_key=f"restored-{round_}")
    if round_ == 1:
        assert restored.usage.prompt_tokens_details.cached_tokens > 0
    session = f"dashboard-{round_}"
    turn = [{"role": "user", "content": "Name three colors."}]
    first = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=6, temperature=0, prompt_cache_key=session)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": LONG_TURN}]  # past the 256-token bucket: the cache grows
    second = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=6, temperature=0, prompt_cache_key=session)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # A prompt whose continuation repeats it: prompt lookup drafts (speculative panels).
    client.completions.create(model=MODEL, prompt=", ".join(str(i % 10) for i in range(60)) + ",", max_tokens=12, temperature=0)
    # A schema new in each round: one compile per round, then a compiled-grammar cache hit.
    schema = {"type": "object", "properties": {f"color_{round_}": {"type": "string"}}, "required": [f"color_{round_}"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}
    for max_tokens in (8, 1):
        structured = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A color as JSON."}], max_tokens=max_tokens,
            temperature=0, response_format=response_format)
        assert structured.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match="schema rejected"):  # bad_schema
        client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}})
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # too_long
        client.chat.completions.create(model=MODEL, messages=turn, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError):  # bad_request
        client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=7)
    with pytest.raises(openai.AuthenticationError):  # auth
        OpenAI(base_url=kvserve.base_url, api_key="wrong", max_retries=0).models.list()
    deleted = httpx.delete(f"{kvserve.base_url}/sessions/{session}", headers={"Authorization": f"Bearer {KEY}"})
    assert deleted.status_code == 204
    for adapter in (*ADAPTERS, *ADAPTERS):
        client.chat.completions.create(model=adapter, messages=turn[:1], max_tokens=4, temperature=0)
    auth = {"Authorization": f"Bearer {KEY}"}
    for action, body, status in (("load", {"lora_name": f"extra-{round_}", "lora_path": "extra"}, 200),
                                 ("load", {"lora_name": "missing", "lora_path": "missing"}, 400),  # not-found
                                 ("unload", {"lora_name": f"extra-{round_}"}, 200)):
        answer = httpx.post(f"{kvserve.url}/v1/{action}_lora_adapter", json=body, headers=auth, timeout=60)
        assert answer.status_code == status, answer.text


@needs_prometheus
def test_every_dashboard_query_returns_data(kvserve, prometheus) -> None:
    wait_for_target_up(prometheus)
    send_traffic(kvserve, 1)
    wait_for_scrape(prometheus, kvserve)  # every labelled series exists before round 2 increments it
    send_traffic(kvserve, 2)
    wait_for_scrape(prometheus, kvserve)

    empty, nan_only = [], []
    for title, expr in queries():
        result = query(prometheus, concrete(expr))
        if not result:
            empty.append(f"{title}: {expr}")
        elif all(math.isnan(float(series["value"][1])) for series in result):
            nan_only.append(f"{title}: {expr}")
    assert not empty, "no data:\n" + "\n".join(empty)
    assert not nan_only, "only NaN:\n" + "\n".join(nan_only)

    # The $job and $instance variables list kvserve_info's labels.
    (info,) = query(prometheus, "kvserve_info")
    assert info["metric"]["job"] == "kvserve" and info["metric"]["instance"]
    # The reuse panels show reuse: a hit ratio above zero and hit TTFTs next to miss TTFTs.
    ratio = query(prometheus, "sum(rate(kvserve_prefix_cache_hits_tokens_total[1m])) / sum(rate(kvserve_prefix_cache_queries_tokens_total[1m]))")
    assert 0 < float(ratio[0]["value"][1]) < 1
    by_cache = query(prometheus, "histogram_quantile(0.5, sum by (le, cache) (rate(kvserve_time_to_first_token_seconds_bucket[1m])))")
    assert {series["metric"]["cache"] for series in by_cache} == {"hit", "miss"}
    reasons = query(prometheus, "sum by (reason) (kvserve_request_rejections_total)")
    assert {series["metric"]["reason"] for series in reasons} >= {"auth", "bad_request", "too_long", "bad_schema"}
    kinds = query(prometheus, "sum by (kind) (kvserve_structured_requests_total)")
    counts = {series["metric"]["kind"]: float(series["value"][1]) for series in kinds}
    assert {kind: n for kind, n in counts.items() if n} == {"json_schema": 4}
    assert {"json_object", "regex", "tool_call_auto"} <= set(counts)  # every kind exists from the start
    assert float(query(prometheus, "sum(kvserve_grammar_cache_hits_total)")[0]["value"][1]) >= 2
    evictions = query(prometheus, "sum by (reason) (kvserve_session_evictions_total)")
    assert {series["metric"]["reason"] for series in evictions if float(series["value"][1])} == {"deleted"}
    assert {series["metric"]["reason"] for series in evictions} == {"deleted", "evicted", "expired"}
    assert float(query(prometheus, "sum(kvserve_kv_cache_grows_total)")[0]["value"][1]) >= 2
    # Every step is counted once by its launch, and every launch has a series from the start;
    # with the overlap off (CPU's default) every step waited for that reason.
    launches = {s["metric"]["launch"]: float(s["value"][1]) for s in query(prometheus, "sum by (launch) (kvserve_engine_steps_total)")}
    assert set(launches) == set(STEP_LAUNCHES)
    assert sum(launches.values()) == float(query(prometheus, "sum(kvserve_engine_step_seconds_count)")[0]["value"][1]) > 0
    (paths,) = query(prometheus, "kvserve_engine_paths_info")
    if paths["metric"]["overlap"] == "off":
        assert {launch for launch, n in launches.items() if n} == {"off"}, launches
    # The KV tier panels: the disk tier is on (a budget; host memory is a CUDA-only tier, off
    # here), and a session came back from it.
    budgets = {s["metric"]["tier"]: float(s["value"][1]) for s in query(prometheus, "sum by (tier) (kvserve_kv_tier_budget_bytes)")}
    assert budgets["device"] > 0 and budgets["disk"] > 0 and budgets["host"] == 0, budgets
    assert float(query(prometheus, 'sum(kvserve_kv_restores_total{tier="disk"})')[0]["value"][1]) >= 1
    writes = query(prometheus, "sum by (result) (kvserve_kv_disk_writes_total)")
    assert {series["metric"]["result"] for series in writes} == {"ok", "failed", "skipped"}
    failures = query(prometheus, "sum(kvserve_kv_restore_failures_total)")
    assert float(failures[0]["value"][1]) == 0
    # The LoRA panels: both adapters' requests, swaps through the one slot, loads by result,
    # and vLLM's info series that llm-d's LoRA-affinity scorer reads.
    per_adapter = query(prometheus, "sum by (adapter) (kvserve_lora_requests_total)")
    assert {s["metric"]["adapter"]: float(s["value"][1]) for s in per_adapter} == {name: 4.0 for name in ADAPTERS}
    assert float(query(prometheus, "sum(kvserve_lora_swaps_total)")[0]["value"][1]) >= 3
    assert float(query(prometheus, "sum(kvserve_lora_slots)")[0]["value"][1]) == 1
    assert float(query(prometheus, "sum(kvserve_lora_adapters_loaded)")[0]["value"][1]) == len(ADAPTERS)
    loads = {(s["metric"]["action"], s["metric"]["result"]): float(s["value"][1])
             for s in query(prometheus, "sum by (action, result) (kvserve_lora_loads_total)")}
    assert loads == {("load", "ok"): 2, ("load", "not-found"): 2, ("unload", "ok"): 2}
    # NOTE: read as llm-d's scheduler reads it, from the pod in the text format: a Prometheus
    # negotiating OpenMetrics gets vLLM's names with `_` for `:` from prometheus_client.
    exposed = text_string_to_metric_families(httpx.get(kvserve.metrics_url, timeout=5).text)
    (info,) = [s for family in exposed for s in family.samples if s.name == "vllm:lora_requests_info"]
    assert info.labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}  # idle
    assert time.time() - 600 < info.value <= time.time()
