"""Worker metrics, exported through Dynamo's system status server (``/metrics`` when
``DYN_SYSTEM_PORT`` is set), with Dynamo's labels (namespace, component, endpoint,
worker_id, model) added at scrape time.

Two kinds: engine state read at scrape time (queue depth, running, finished counts,
steps), and per-request cost — the cost model's prediction at admission and the measured
cost at the end — plus the predicted cost of everything in flight, the load signal a
planner or router can weigh requests by (design §6.3.5 item 2, ask A2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

from omniloop.serve.engine_metrics import EngineStateCollector

if TYPE_CHECKING:
    from omniloop.engine import AsyncEngine

PREFIX = "omniloop_"
# Predicted/actual GPU-seconds span ~4 decades (a 4-step 256p clip .. a 50-step 720p one).
_COST_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


class WorkerMetrics:
    def __init__(self, engine: "AsyncEngine") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStateCollector(engine.stats))
        self.predicted = Histogram(f"{PREFIX}request_predicted_cost_seconds",
                                   "cost model's predicted seconds per admitted request", buckets=_COST_BUCKETS,
                                   registry=self.registry)
        self.actual = Histogram(f"{PREFIX}request_actual_cost_seconds", "measured compute seconds per finished request",
                                buckets=_COST_BUCKETS, registry=self.registry)
        self.inflight_cost = Gauge(f"{PREFIX}inflight_predicted_cost_seconds",
                                   "sum of predicted seconds of admitted, unfinished requests", registry=self.registry)

    def admitted(self, predicted_s: float | None) -> None:
        if predicted_s is not None:
            self.predicted.observe(predicted_s)
            self.inflight_cost.inc(predicted_s)

    def finished(self, predicted_s: float | None, actual_s: float | None) -> None:
        if predicted_s is not None:
            self.inflight_cost.dec(predicted_s)
        if actual_s is not None:
            self.actual.observe(actual_s)

    def export(self, endpoint: Any, *, namespace: str, component: str, endpoint_name: str, model: str) -> None:
        """Append these metrics to the runtime's ``/metrics`` (call once per process)."""
        from dynamo.common.utils.prometheus import register_engine_metrics_callback

        register_engine_metrics_callback(endpoint, self.registry, metric_prefix_filters=[PREFIX],
                                         namespace_name=namespace, component_name=component,
                                         endpoint_name=endpoint_name, model_name=model)
