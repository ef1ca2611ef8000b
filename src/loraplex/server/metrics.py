"""Prometheus metrics: request latency by adapter warmth, adapter tiers, and the Gateway API
Inference Extension's model-server gauges (``vllm:*``), so standard gateways can route to us.

Each app owns its own :class:`CollectorRegistry` (no process-global state). Counters that the
engine already keeps (tier hits, loads, evictions) are read at scrape time by a collector rather
than mirrored, so they can never drift. Adapter names appear as label values only inside
``vllm:lora_requests_info``, each list bounded by :data:`MAX_ADAPTER_LABELS` names (the waiting
ones: those with the most waiting sequences). Who may read them is the route's business
(:mod:`~loraplex.server.auth`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from loraplex.engine.client import EngineClient, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
MAX_ADAPTER_LABELS = 64
"""Most adapter names listed in one label value (device-resident or waiting): top-K."""


def _bounded(names: Iterable[str]) -> str:
    """Comma-joined distinct ``names`` in the given order, at most :data:`MAX_ADAPTER_LABELS`."""
    return ",".join(list(dict.fromkeys(names))[:MAX_ADAPTER_LABELS])


class _EngineCollector(Collector):
    """Gauges and tier counters computed from the engine's state at scrape time (through its
    client)."""

    def __init__(self, client: EngineClient, adapter_names: Callable[[str], list[str]]) -> None:
        self._client = client
        self._names = adapter_names  # digest -> served names

    def collect(self) -> Iterable[Metric]:
        client = self._client
        waiting = client.num_waiting
        running = client.num_running
        yield GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", value=waiting
        )
        yield GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the running batch.", value=running
        )
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            value=client.kv_cache_usage(),
        )
        lora = client.lora_enabled
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters resident on the device (idle or busy) and adapters of waiting requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        if lora:
            resident = sorted(n for d in client.device_adapter_digests() for n in self._names(d))
            counts = client.waiting_adapter_counts()
            most = sorted(counts, key=lambda d: -counts[d])
            waiting_names = [n for d in most for n in self._names(d)]
            info.add_metric(
                [str(client.max_loras), _bounded(resident), _bounded(waiting_names)],
                time.time(),
            )
        yield info
        yield CounterMetricFamily(
            "loraplex_streams_stalled",
            "Requests aborted because their client stopped reading the stream.",
            value=client.num_stalled,
        )
        if not lora:
            return
        st = client.cache_stats
        tiers = client.tier_counters()  # device, host (and disk when configured)
        hits = CounterMetricFamily(
            "adapter_cache_hits", "Adapter lookups served from a tier.", labels=["tier"]
        )
        ev = CounterMetricFamily(
            "adapter_evictions", "Adapters evicted from a tier.", labels=["tier"]
        )
        reload = CounterMetricFamily(
            "adapter_reload_after_eviction",
            "Adapters loaded again into a tier soon (thrash window) after being evicted from it.",
            labels=["tier"],
        )
        thrash = GaugeMetricFamily(
            "adapter_thrash_ratio",
            "Reloads within the window after an eviction / evictions, per tier.",
            labels=["tier"],
        )
        for tier, c in tiers.items():
            hits.add_metric([tier], c.hits)
            ev.add_metric([tier], c.evictions)
            reload.add_metric([tier], c.reload_after_eviction)
            thrash.add_metric([tier], c.thrash_ratio)
        yield hits
        yield ev
        yield reload
        yield thrash
        yield CounterMetricFamily(
            "adapter_cache_misses",
            "Adapter lookups that missed host memory (a load from disk or the object store).",
            value=tiers["host"].misses,
        )
        yield CounterMetricFamily(
            "adapter_remote_loads",
            "Adapters downloaded from the object store.",
            value=st.remote_loads,
        )
        yield CounterMetricFamily(
            "adapter_load_failures", "Adapter loads that failed.", value=st.load_failures
        )
        yield CounterMetricFamily(
            "cold_adapter_requests",
            "Requests whose adapter was not in device or host memory on arrival.",
            value=st.cold_requests,
        )
        count = GaugeMetricFamily(
            "adapter_resident_count", "Adapters resident in a tier.", labels=["tier"]
        )
        nbytes = GaugeMetricFamily(
            "adapter_resident_bytes",
            "Bytes of adapter weights resident in a tier.",
            labels=["tier"],
        )
        for tier, (n, b) in client.resident_bytes().items():
            count.add_metric([tier], n)
            nbytes.add_metric([tier], b)
        yield count
        yield nbytes
        yield GaugeMetricFamily("loraplex_max_loras", "Device LoRA slots.", value=client.max_loras)


class ServerMetrics:
    """All metrics of one server instance."""

    def __init__(self, client: EngineClient, adapter_names: Callable[[str], list[str]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            ["adapter_state"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            ["adapter_state"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            ["adapter_state"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "loraplex_requests", "Finished HTTP requests by status.", ["status"], registry=r
        )
        self.finished = Counter(
            "loraplex_request_success",
            "Completions finished by the engine, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Tokens generated.", registry=r
        )
        self.load_seconds = Histogram(
            "adapter_load_seconds",
            "Seconds spent per adapter load stage.",
            ["stage"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.distinct_adapters = Histogram(
            "distinct_adapters_per_step",
            "Distinct adapters in one engine step.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.step_errors = Counter(
            "loraplex_engine_step_errors", "Engine steps that raised.", registry=r
        )
        r.register(_EngineCollector(client, adapter_names))
        client.add_step_observer(self._on_step)
        client.add_load_observer(self._on_load)

    def _on_step(self, stats: StepStats) -> None:
        self.distinct_adapters.observe(stats.distinct_adapters)

    def _on_load(self, stage: str, seconds: float) -> None:
        self.load_seconds.labels(stage=stage).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
