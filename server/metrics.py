"""Every Prometheus metric of kvserve, defined once (names `kvserve_*`).

Each app gets its own registry, so several apps in one process (the tests) never collide.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)

from cache_manager.disk import FAILURE_REASONS as RESTORE_FAILURE_REASONS
from server import __version__
from cache_manager.manager import NO_SESSION, TIER_MISS_REASONS
from cache_manager.prefix import MISS_REASONS as PREFIX_MISS_REASONS
from grammars.compile import GrammarKind

# Every label value the code uses, created at start so each series exists (at 0) on a fresh
# server and no dashboard panel shows "No data".
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
FINISH_REASONS = ("stop", "length", "abort", "error")
POOLING_TASKS = ("embed", "rerank")
REJECTION_REASONS = ("auth", "bad_request", "too_long", "too_large", "bad_schema", "kv_budget", "queue_full", "session_busy")
EVICTION_REASONS = ("evicted", "expired", "deleted")
STRUCTURED_KINDS = (*get_args(GrammarKind), "tool_call_forced", "tool_call_auto")
MISS_REASONS = (*PREFIX_MISS_REASONS, NO_SESSION, *TIER_MISS_REASONS)
TIERS = ("device", "host", "disk")
LOWER_TIERS = ("host", "disk")
DISK_WRITE_RESULTS = ("ok", "failed", "skipped")
# server/engine/core.py's faults: a row failed alone in a forward pass (`forward`) or when its
# token was chosen (`sampling`); a step shrank after running out of memory (`oom_shrink`) or a
# row could not run even alone (`oom_row`); the model failed a known-good check (`engine_dead`)
ENGINE_FAULTS = ("forward", "sampling", "oom_shrink", "oom_row", "engine_dead")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # NOTE: the default registry has these; an app's own does not (process_resident_memory_bytes).
        ProcessCollector(registry=r)
        self.info = Info("kvserve", "Model, dtype, device and kvserve version.", registry=r)
        # on every server from its start, whatever it serves (a Grafana panel and `kvserve --version` agree)
        build = Info("kvserve_build", "kvserve's version and the Python, torch and transformers it runs on.", registry=r)
        build.info({"version": __version__, "python": platform.python_version(), **{p: _version(p) for p in ("torch", "transformers")}})
        self.engine_paths = Info(
            "kvserve_engine_paths",
            "How each fast path runs (attention, paged_attention, merged, compile, cuda_graphs, overlap, cpu_linear, exact, "
            "speculative; experts, lora, recurrent where the model has them) and "
            "`fallbacks`: the paths running slower than asked (none: \"\").",
            registry=r,
        )
        self.engine_faults = Counter(
            "kvserve_engine_faults", "Faults inside the engine, by kind (see ENGINE_FAULTS).", ["kind"], registry=r
        )
        self.requests = Counter(
            "kvserve_http_requests", "HTTP requests by route and status.",
            ["route", "method", "status"], registry=r,
        )
        self.finished = Counter(
            "kvserve_request_finished", "Generation requests by route and finish reason.",
            ["route", "finish_reason"], registry=r,
        )
        self.rejections = Counter(
            "kvserve_request_rejections", "Requests refused before generation, by reason.",
            ["reason"], registry=r,
        )
        self.requests_running = Gauge(
            "kvserve_requests_running", "Sequences being prefilled or decoded.", registry=r
        )
        self.requests_waiting = Gauge(
            "kvserve_requests_waiting", "Sequences waiting for the engine.", registry=r
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "kvserve_prompt_tokens_cached", "Prompt tokens served from a session's KV cache.", registry=r
        )
        self.pooled_inputs = Counter(
            "kvserve_pooled_inputs", "Inputs embedded (--task embed) or pairs scored (--task rerank), by task.", ["task"], registry=r
        )
        self.pooled_tokens = Counter("kvserve_pooled_tokens", "Tokens of the pooled inputs, by task.", ["task"], registry=r)
        for task in POOLING_TASKS:
            self.pooled_inputs.labels(task)
            self.pooled_tokens.labels(task)
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds", "Time from arrival to the first token.",
            ["cache"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds", "Time between two tokens of one sequence.",
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "kvserve_queue_time_seconds", "Time a sequence waited before the engine took it.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prompt_length = Histogram(
            "kvserve_request_prompt_tokens", "Prompt length per request.",
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.generation_length = Histogram(
            "kvserve_request_generation_tokens", "Generated tokens per request.",
            buckets=TOKEN_BUCKETS, registry=r,
        )

        # -- batched engine ----------------------------------------------------------------------
        self.batch_rows = Histogram(
            "kvserve_batch_rows", "Sequences (rows) in one engine step's forward pass.",
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256), registry=r,
        )
        self.batch_tokens = Histogram(
            "kvserve_batch_tokens",
            "Tokens computed in one engine step's forward pass (decode rows + prefill chunks).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), registry=r,
        )
        self.step_seconds = Histogram(
            "kvserve_engine_step_seconds", "Wall time of one engine step (schedule, forward pass, sampling).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )

        # -- session KV reuse ------------------------------------------------------------------
        self.prefix_queries = Counter(
            "kvserve_prefix_cache_queries_tokens", "Prompt tokens looked up in session caches.", registry=r
        )
        self.prefix_hits = Counter(
            "kvserve_prefix_cache_hits_tokens", "Prompt tokens whose KV was reused.", registry=r
        )
        self.cache_misses = Counter(
            "kvserve_prefix_cache_misses", "Requests that reused nothing, by reason.", ["reason"], registry=r
        )
        self.sessions_resident = Gauge(
            "kvserve_sessions_resident", "Sessions holding a KV cache.", registry=r
        )
        self.kv_bytes_used = Gauge(
            "kvserve_kv_cache_bytes_used", "Bytes of KV cache allocated (sessions and private).", registry=r
        )
        self.kv_bytes_budget = Gauge(
            "kvserve_kv_cache_bytes_budget", "The KV cache byte budget.", registry=r
        )
        self.rank_step_seconds = Gauge(
            "kvserve_rank_step_seconds",
            "Each tensor-parallel rank's mean forward pass over the last few seconds with steps (on CUDA the time "
            "to launch it), by rank; one process is rank 0.", ["rank"], registry=r,
        )
        self.rank_memory_bytes = Gauge(
            "kvserve_rank_memory_bytes",
            "Each tensor-parallel rank's memory, by rank and kind: weights (its shard), in_use (CUDA: allocated "
            "by torch; CPU: the process's resident set); one process is rank 0. Every rank's KV pool is the same "
            "size.", ["rank", "kind"], registry=r,
        )
        self.kv_tokens_capacity = Gauge(
            "kvserve_kv_cache_capacity_tokens",
            "Tokens the KV budget holds, all sequences together (in --kv-cache-dtype's bytes per token).",
            registry=r,
        )
        self.kv_tokens_used = Gauge(
            "kvserve_kv_cache_tokens_used",
            "Token slots of the KV blocks sessions and in-flight requests hold (whole blocks of 16).",
            registry=r,
        )
        self.cache_evictions = Counter(
            "kvserve_session_evictions", "Sessions dropped, by reason (evicted, expired, deleted).",
            ["reason"], registry=r,
        )
        self.cache_grows = Counter(
            "kvserve_kv_cache_grows", "Session caches moved to a larger capacity bucket.", registry=r
        )

        # -- KV tiers (host memory, disk) ------------------------------------------------------
        self.kv_demotions = Counter(
            "kvserve_kv_demotions", "Idle sessions moved down to a tier (evicted from the one above).",
            ["tier"], registry=r,
        )
        self.kv_restores = Counter(
            "kvserve_kv_restores", "Sessions whose KV was restored from a tier instead of recomputed.",
            ["tier"], registry=r,
        )
        self.kv_restore_seconds = Histogram(
            "kvserve_kv_restore_seconds", "Time to restore one session's KV to the device.",
            ["tier"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r,
        )
        self.kv_restore_failures = Counter(
            "kvserve_kv_restore_failures",
            "Parked session copies that could not be used (deleted, then recomputed), by reason.",
            ["tier", "reason"], registry=r,
        )
        self.kv_disk_writes = Counter(
            "kvserve_kv_disk_writes", "Session files written (ok), failed (I/O, disk full) or skipped (no room).",
            ["result"], registry=r,
        )

        # -- structured output -------------------------------------------------------------------
        self.structured_requests = Counter(
            "kvserve_structured_requests", "Requests constrained by a grammar, by kind.", ["kind"], registry=r
        )
        self.grammar_compile_seconds = Histogram(
            "kvserve_grammar_compile_seconds", "Time to compile a grammar (cache misses only).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r,
        )
        self.grammar_mask_seconds = Histogram(
            "kvserve_grammar_mask_seconds", "Time to compute one token mask (in a worker thread).",
            buckets=(0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01), registry=r,
        )

        # -- speculative decoding ----------------------------------------------------------------
        self.spec_draft_tokens = Counter(
            "kvserve_spec_decode_draft_tokens", "Drafted tokens sent to verification (--speculative).", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "kvserve_spec_decode_accepted_tokens", "Drafted tokens the model accepted.", registry=r
        )
        self.spec_acceptance_rate = Histogram(
            "kvserve_spec_decode_acceptance_rate",
            "Per finished request that drafted: accepted / drafted tokens.",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r,
        )
        self.spec_tokens_per_forward = Histogram(
            "kvserve_spec_decode_tokens_per_forward",
            "Tokens a sequence with a draft gained from one forward pass (accepted drafts + 1).",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 65), registry=r,
        )

        # -- LoRA adapters -----------------------------------------------------------------------
        # NOTE: per-adapter series appear with an adapter's first request and go with its unload
        # (`forget_adapter`); none exist on a server without adapters.
        self.lora_requests = Counter(
            "kvserve_lora_requests", "Finished generation requests on each LoRA adapter.", ["adapter"], registry=r
        )
        self.lora_prompt_tokens = Counter(
            "kvserve_lora_prompt_tokens", "Prompt tokens of finished requests on each LoRA adapter.", ["adapter"], registry=r
        )
        self.lora_generation_tokens = Counter(
            "kvserve_lora_generation_tokens", "Tokens generated on each LoRA adapter.", ["adapter"], registry=r
        )
        self.lora_loads = Counter(
            "kvserve_lora_loads",
            "Runtime adapter loads and unloads (/v1/load_lora_adapter, /v1/unload_lora_adapter) by "
            "action and result: ok or the refusal's reason (name-clash, not-found, shapes, rank, ...).",
            ["action", "result"], registry=r,
        )
        # images in (server/api/media.py, server/engine/vision.py)
        self.images = Counter("kvserve_images", "Images received in requests (chat `image_url`, Responses `input_image`).", registry=r)
        self.image_tokens = Counter("kvserve_image_tokens", "Prompt positions that hold images (their placeholder runs).", registry=r)
        self.encoder_seconds = Histogram("kvserve_vision_encoder_seconds", "Seconds the vision encoder spent on one image "
                                         "(features not found in the encoder cache).", buckets=LATENCY_BUCKETS, registry=r)
        self.encoder_cache_lookups = Counter("kvserve_vision_encoder_cache_lookups", "Encoder-cache lookups of an image's "
                                             "features by its digest: hit or miss.", ["result"], registry=r)
        self.encoder_cache_bytes = Gauge("kvserve_vision_encoder_cache_bytes", "Bytes of image features the encoder cache holds.",
                                         registry=r)
        # (max_lora, running, waiting, unix time): vllm:lora_requests_info's one series, None
        # until the engine first reports; replaced whole, so a scrape never sees half of it
        self._lora_info: tuple[str, str, str, float] | None = None

        self._preset()
        r.register(_VllmGauges(self))
        # the LoRA series exist on every server, at 0 without adapters (the dashboard's LoRA row
        # then reads 0, not "no data"); `watch_adapters` hands it the adapters
        self._adapters = _AdapterCollector(None)
        r.register(self._adapters)

    def _preset(self) -> None:
        for route in ROUTES:
            for reason in FINISH_REASONS:
                self.finished.labels(route, reason)
        for counter, values in (
            (self.rejections, REJECTION_REASONS),
            (self.cache_evictions, EVICTION_REASONS),
            (self.structured_requests, STRUCTURED_KINDS),
            (self.cache_misses, MISS_REASONS),
            (self.engine_faults, ENGINE_FAULTS),
        ):
            for value in values:
                counter.labels(value)
        for tier in LOWER_TIERS:
            self.kv_demotions.labels(tier)
            self.kv_restores.labels(tier)
            self.kv_restore_seconds.labels(tier)
            for reason in RESTORE_FAILURE_REASONS:
                self.kv_restore_failures.labels(tier, reason)
        for result in DISK_WRITE_RESULTS:
            self.kv_disk_writes.labels(result)

    def watch_grammar_cache(self, compiler) -> None:
        """Export the compiler's own hit/miss counters (it counts under its lock)."""
        self.registry.register(_GrammarCacheCollector(compiler))

    def watch_response_store(self, store) -> None:
        """Export the response store's size, budget, evictions and lookups, read at scrape time."""
        self.registry.register(_ResponseStoreCollector(store))

    def watch_tiers(self, cache_manager) -> None:
        """Export bytes, budget and sessions of every KV tier, read at scrape time."""
        self.registry.register(_TierCollector(cache_manager))

    def watch_engine(self, engine) -> None:
        """Export the engine's count of its steps by how each was launched, read at scrape time."""
        self.registry.register(_EngineStepsCollector(engine))

    def watch_adapters(self, adapters) -> None:
        """Export the LoRA adapters loaded, resident in device slots, the slots, swaps and bytes,
        read at scrape time."""
        self._adapters.adapters = adapters

    def lora_requests_info(self, max_lora: int, running: list[str], waiting: list[str]) -> None:
        """Report the adapters of the running and waiting requests as `vllm:lora_requests_info`
        (llm-d's LoRA-affinity scorer reads it): one series whose labels are the latest lists and
        whose value is the time of this call; the previous label set disappears."""
        self._lora_info = (str(max_lora), ",".join(running), ",".join(waiting), time.time())

    def lora_request(self, adapter: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one finished request on `adapter` and its tokens."""
        self.lora_requests.labels(adapter).inc()
        self.lora_prompt_tokens.labels(adapter).inc(prompt_tokens)
        self.lora_generation_tokens.labels(adapter).inc(completion_tokens)

    def forget_adapter(self, name: str) -> None:
        """Drop the per-adapter series of an unloaded adapter (nothing if it has none)."""
        for counter in (self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens):
            counter.remove(name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCacheCollector:
    def __init__(self, compiler) -> None:
        self.compiler = compiler

    def collect(self):
        c = self.compiler
        for name, value in (("hits", c.hits), ("misses", c.misses), ("evictions", c.evictions)):
            family = CounterMetricFamily(f"kvserve_grammar_cache_{name}", f"Compiled-grammar cache {name}.")
            family.add_metric([], value)
            yield family
        yield GaugeMetricFamily(
            "kvserve_grammar_cache_bytes", "Estimated bytes of the cached compiled grammars (--grammar-cache-bytes).", value=c.nbytes
        )


class _EngineStepsCollector:
    def __init__(self, engine) -> None:
        self.engine = engine  # server.engine.core.Engine: `steps`, counted on its thread

    def collect(self):
        family = CounterMetricFamily(
            "kvserve_engine_steps",
            "Engine steps by launch: ahead (the overlap: launched while the previous step's tokens were postprocessed) "
            "or why it waited for them: off (no overlap), host (a row's token chosen on the host: penalties, logprobs, "
            "drafts), prefill, forced (tokens a grammar or a thinking budget forced), admission (requests or calls "
            "waiting), idle (no row went on from the step before), fault.",
            labels=["launch"],
        )
        for launch, count in dict(self.engine.steps).items():
            family.add_metric([launch], count)
        yield family


class _ResponseStoreCollector:
    def __init__(self, store) -> None:
        self.store = store  # server.api.response_store.ResponseStore

    def collect(self):
        s = self.store
        yield GaugeMetricFamily("kvserve_response_store_bytes", "Bytes of stored responses (/v1/responses, store: true).", value=s.nbytes)
        yield GaugeMetricFamily("kvserve_response_store_budget_bytes", "Byte budget of the response store (--response-store-bytes).", value=s.budget_bytes)
        yield GaugeMetricFamily("kvserve_response_store_responses", "Stored responses.", value=len(s))
        evictions = CounterMetricFamily(
            "kvserve_response_store_evictions", "Stored responses dropped: evicted (budget) or deleted.", labels=["reason"]
        )
        for reason, count in s.evictions.items():
            evictions.add_metric([reason], count)
        yield evictions
        lookups = CounterMetricFamily(
            "kvserve_response_store_lookups",
            "Lookups of stored responses (retrieve, input_items, previous_response_id): hit or miss (404).",
            labels=["result"],
        )
        lookups.add_metric(["hit"], s.hits)
        lookups.add_metric(["miss"], s.misses)
        yield lookups


class _TierCollector:
    def __init__(self, cache_manager) -> None:
        self.cache_manager = cache_manager

    def collect(self):
        families = {
            "bytes": GaugeMetricFamily("kvserve_kv_tier_bytes", "Bytes of KV held in each tier (device: sessions and private caches).", labels=["tier"]),
            "budget": GaugeMetricFamily("kvserve_kv_tier_budget_bytes", "Byte budget of each tier (0: the tier is off).", labels=["tier"]),
            "sessions": GaugeMetricFamily("kvserve_kv_tier_sessions", "Sessions whose KV is in each tier.", labels=["tier"]),
        }
        for tier, (used, budget, sessions) in self.cache_manager.tier_usage().items():
            families["bytes"].add_metric([tier], used)
            families["budget"].add_metric([tier], budget)
            families["sessions"].add_metric([tier], sessions)
        yield from families.values()
        disk = getattr(self.cache_manager, "disk", None)
        files, free = disk.disk_usage() if disk is not None else (0, 0)
        yield GaugeMetricFamily(
            "kvserve_kv_disk_file_bytes",
            "Bytes the disk tier's session files take on the medium (allocated blocks, writes in progress included; 0: off).",
            value=files,
        )
        yield GaugeMetricFamily("kvserve_kv_disk_free_bytes", "Free bytes of the disk tier's file system (0: off).", value=free)


class _AdapterCollector:
    def __init__(self, adapters) -> None:
        self.adapters = adapters  # server.engine.lora.Adapters, or None (all 0)

    def collect(self):
        a = self.adapters
        slots = a.slots if a is not None else []
        loaded, swaps, device, host = (len(a.names), a.swaps, a.nbytes, a.host_bytes) if a is not None else (0, 0, 0, 0)
        yield GaugeMetricFamily("kvserve_lora_adapters_loaded", "LoRA adapters loaded (host memory; --max-cpu-loras).", value=loaded)
        yield GaugeMetricFamily(
            "kvserve_lora_adapters_resident", "LoRA adapters resident in a device slot.", value=sum(s is not None for s in slots)
        )
        yield GaugeMetricFamily("kvserve_lora_slots", "Device slots allocated for LoRA adapters (at most --max-loras).", value=len(slots))
        yield CounterMetricFamily("kvserve_lora_swaps", "LoRA adapters copied into a device slot after the start.", value=swaps)
        yield GaugeMetricFamily("kvserve_lora_device_bytes", "Device bytes of the LoRA slots' matrices.", value=device)
        yield GaugeMetricFamily("kvserve_lora_host_bytes", "Host bytes of every loaded LoRA adapter's matrices.", value=host)


def _value(gauge: Gauge) -> float:
    return gauge.collect()[0].samples[0].value


class _VllmGauges:
    """vLLM's names for the gauges llm-d / Gateway API Inference Extension schedulers read by
    default, derived from kvserve's own at scrape time (one source of truth)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        budget = _value(m.kv_bytes_budget)
        usage = _value(m.kv_bytes_used) / budget if budget > 0 else 0.0
        for name, doc, value in (
            ("vllm:num_requests_waiting", "Requests waiting for the engine (kvserve_requests_waiting).", _value(m.requests_waiting)),
            ("vllm:num_requests_running", "Requests in the running batch (kvserve_requests_running).", _value(m.requests_running)),
            ("vllm:kv_cache_usage_perc", "Fraction (0-1) of the KV budget in use, idle resident sessions included.", min(usage, 1.0)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if (info := m._lora_info) is not None:
            *labels, when = info
            family = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Adapters of the running and waiting requests (comma-separated) and the adapter slots; "
                "value: the unix time of the engine's last report.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            family.add_metric(labels, when)
            yield family


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
