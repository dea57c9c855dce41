"""LoRA metrics on a bare `Metrics` (no model): the per-adapter counters, the adapters'
collector read at scrape time, and vLLM's `vllm:lora_requests_info` that llm-d's LoRA-affinity
scorer reads."""

from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics

INFO = "vllm:lora_requests_info"


def scrape(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], from the exposition text a scrape gets."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(series: dict, name: str, **labels: str) -> float:
    [v] = [v for l, v in series[name] if l == labels]
    return v


@dataclass
class FakeAdapters:
    """What the collector reads of server.engine.lora.Adapters."""

    names: list[str] = field(default_factory=list)
    slots: list[str | None] = field(default_factory=list)
    swaps: int = 0
    max_loras: int = 2
    nbytes: int = 0
    host_bytes: int = 0


def test_a_server_without_adapters_shows_its_lora_gauges_at_zero_and_no_adapter():
    """The dashboard's LoRA row reads 0 on a server without adapters (issue 53), and no
    per-adapter series or vLLM's lora_requests_info appears."""
    series = scrape(Metrics())
    lora = {name: values for name, values in series.items() if "lora" in name}
    assert set(lora) == {"kvserve_lora_adapters_loaded", "kvserve_lora_adapters_resident", "kvserve_lora_slots",
                         "kvserve_lora_swaps_total", "kvserve_lora_device_bytes", "kvserve_lora_host_bytes"}
    assert all(values == [({}, 0.0)] for values in lora.values()), lora


def test_lora_requests_info_keeps_one_series_with_the_latest_labels(monkeypatch):
    metrics = Metrics()
    monkeypatch.setattr("server.metrics.time.time", lambda: 1000.0)
    metrics.lora_requests_info(4, running=["sql", "poet"], waiting=[])
    assert scrape(metrics)[INFO] == [
        ({"max_lora": "4", "running_lora_adapters": "sql,poet", "waiting_lora_adapters": ""}, 1000.0)
    ]
    monkeypatch.setattr("server.metrics.time.time", lambda: 1001.5)
    metrics.lora_requests_info(4, running=["poet"], waiting=["sql"])
    assert scrape(metrics)[INFO] == [
        ({"max_lora": "4", "running_lora_adapters": "poet", "waiting_lora_adapters": "sql"}, 1001.5)
    ]
    metrics.lora_requests_info(4, running=[], waiting=[])
    assert scrape(metrics)[INFO] == [
        ({"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}, 1001.5)
    ]


def test_lora_request_counts_per_adapter_and_forget_adapter_drops_its_series():
    metrics = Metrics()
    metrics.lora_request("sql", prompt_tokens=10, completion_tokens=3)
    metrics.lora_request("sql", prompt_tokens=5, completion_tokens=2)
    metrics.lora_request("poet", prompt_tokens=7, completion_tokens=1)
    series = scrape(metrics)
    assert value(series, "kvserve_lora_requests_total", adapter="sql") == 2
    assert value(series, "kvserve_lora_prompt_tokens_total", adapter="sql") == 15
    assert value(series, "kvserve_lora_generation_tokens_total", adapter="sql") == 5
    assert value(series, "kvserve_lora_requests_total", adapter="poet") == 1

    metrics.forget_adapter("sql")
    metrics.forget_adapter("never-loaded")  # no error
    series = scrape(metrics)
    for name in ("kvserve_lora_requests_total", "kvserve_lora_prompt_tokens_total", "kvserve_lora_generation_tokens_total"):
        assert [l["adapter"] for l, _ in series[name]] == ["poet"]


def test_lora_loads_counts_by_action_and_result_without_preset_series():
    metrics = Metrics()
    assert "kvserve_lora_loads_total" not in scrape(metrics)
    metrics.lora_loads.labels("load", "ok").inc()
    metrics.lora_loads.labels("load", "name-clash").inc()
    metrics.lora_loads.labels("unload", "not-found").inc()
    series = scrape(metrics)
    assert sorted((l["action"], l["result"]) for l, _ in series["kvserve_lora_loads_total"]) == [
        ("load", "name-clash"), ("load", "ok"), ("unload", "not-found")
    ]


def test_watch_adapters_reads_the_adapters_at_scrape_time():
    metrics, adapters = Metrics(), FakeAdapters()
    metrics.watch_adapters(adapters)
    series = scrape(metrics)
    for name in ("kvserve_lora_adapters_loaded", "kvserve_lora_adapters_resident", "kvserve_lora_slots",
                 "kvserve_lora_swaps_total", "kvserve_lora_device_bytes", "kvserve_lora_host_bytes"):
        assert value(series, name) == 0

    adapters.names, adapters.slots = ["sql", "poet", "pirate"], ["poet", None, "sql"]
    adapters.swaps, adapters.nbytes, adapters.host_bytes = 5, 4096, 12288
    series = scrape(metrics)
    assert value(series, "kvserve_lora_adapters_loaded") == 3
    assert value(series, "kvserve_lora_adapters_resident") == 2
    assert value(series, "kvserve_lora_slots") == 3
    assert value(series, "kvserve_lora_swaps_total") == 5
    assert value(series, "kvserve_lora_device_bytes") == 4096
    assert value(series, "kvserve_lora_host_bytes") == 12288


@pytest.mark.parametrize("name", ["kvserve_lora_requests_total", "kvserve_lora_swaps_total", INFO])
def test_lora_metric_types_follow_their_names(name):
    metrics = Metrics()
    metrics.watch_adapters(FakeAdapters())
    metrics.lora_request("sql", 1, 1)
    metrics.lora_requests_info(1, ["sql"], [])
    kinds = {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}
    expected = "gauge" if name == INFO else "counter"
    assert kinds[name.removesuffix("_total")] == expected
