"""Prometheus metrics: the server's request counters and latency histograms, plus the
engine's live state (queue depth, running, step counters, cost-model calibration) read
from ``AsyncEngine.stats()`` at scrape time. One registry per app, so several servers
in one process (tests) never collide."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from omniloop.request import RequestMetrics, RequestStatus
from omniloop.serve.engine_metrics import EngineStateCollector

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10)


class _CacheCollector:
    """The text-embedding and adapter caches' counters per served model, read when scraped
    (``AsyncEngine.cache_summaries``: model -> cache -> summary)."""

    def __init__(self, summaries: Callable[[], dict[str, dict[str, dict[str, Any]]]]) -> None:
        self._summaries = summaries

    def collect(self) -> Iterator[Metric]:
        lookups = CounterMetricFamily("omniloop_text_cache_lookups", "text-embedding cache lookups (one per prompt "
                                      "and encoder) by result", labels=["model", "result"])
        text = {name: GaugeMetricFamily(f"omniloop_text_cache_{name}", help_, labels=["model"])
                for name, help_ in (("bytes", "bytes of cached embeddings"), ("entries", "cached embeddings"),
                                    ("hit_rate", "hits / lookups since start"))}
        evictions = CounterMetricFamily("omniloop_text_cache_evictions", "entries evicted for room", labels=["model"])
        lora = CounterMetricFamily("omniloop_lora_cache_events", "adapter cache: device_hits, host_loads (host -> "
                                   "device), disk_loads (file reads), evictions per tier", labels=["model", "event"])
        lora_bytes = GaugeMetricFamily("omniloop_lora_cache_bytes", "resident LoRA bytes per tier",
                                       labels=["model", "tier"])
        loaded = GaugeMetricFamily("omniloop_loras_loaded", "registered LoRAs", labels=["model"])
        for model, caches in sorted(self._summaries().items()):
            if (t := caches.get("text_embeddings")) is not None:
                lookups.add_metric([model, "hit"], t["hits"])
                lookups.add_metric([model, "miss"], t["misses"])
                for name, family in text.items():
                    family.add_metric([model], t[name])
                evictions.add_metric([model], t["evictions"])
            if (a := caches.get("adapters")) is not None:
                for event in ("device_hits", "host_loads", "disk_loads", "device_evictions", "host_evictions",
                              "over_budget"):
                    lora.add_metric([model, event], a[event])
                lora_bytes.add_metric([model, "device"], a["device_bytes"])
                lora_bytes.add_metric([model, "host"], a["host_bytes"])
                loaded.add_metric([model], a["loaded"])
        yield from (lookups, *text.values(), evictions, lora, lora_bytes, loaded)


class ServeMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]],
                 cache_summaries: Callable[[], dict[str, dict[str, dict[str, Any]]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omniloop_requests", "finished requests by kind and final status",
                                ["kind", "status"], registry=r)
        self.rejected = Counter("omniloop_requests_rejected", "requests refused at submission, by HTTP status",
                                ["kind", "code"], registry=r)
        self.latency = Histogram("omniloop_request_latency_seconds", "arrival to finish (queue + run)",
                                 ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("omniloop_request_queue_seconds", "arrival to first scheduled work",
                                    ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("omniloop_step_seconds", "mean loop-step time of each finished request",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.predicted_cost = Histogram("omniloop_request_predicted_cost_seconds",
                                        "cost model's compute-seconds estimate at admission",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.actual_cost = Histogram("omniloop_request_actual_cost_seconds", "measured compute seconds",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.cost_ratio = Histogram("omniloop_request_cost_ratio", "actual / predicted compute seconds "
                                    "(completed requests)", buckets=_RATIO_BUCKETS, registry=r)
        r.register(EngineStateCollector(engine_stats, aliases=True))
        if cache_summaries is not None:
            r.register(_CacheCollector(cache_summaries))  # type: ignore[arg-type]

    def observe_finished(self, kind: str, status: RequestStatus, m: RequestMetrics, loop_nodes: set[str]) -> None:
        self.requests.labels(kind, status.value).inc()
        self.latency.labels(kind).observe(m.queue_s + m.run_s)
        self.queue_time.labels(kind).observe(m.queue_s)
        loop_s = sum(m.node_s.get(n, 0.0) for n in loop_nodes)
        if m.steps:
            self.step_time.observe(loop_s / m.steps)
        if m.predicted_cost_s is not None:
            self.predicted_cost.observe(m.predicted_cost_s)
        if m.actual_cost_s is not None:
            self.actual_cost.observe(m.actual_cost_s)
        if status is RequestStatus.COMPLETED and m.predicted_cost_s and m.actual_cost_s is not None:
            self.cost_ratio.observe(m.actual_cost_s / m.predicted_cost_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
