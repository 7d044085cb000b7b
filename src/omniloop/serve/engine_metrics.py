"""The engine's live state as Prometheus metrics, one set of names for every front end.

The HTTP server (``serve/metrics.py``) and the Dynamo worker (``serve/dynamo/metrics.py``)
both register ``EngineStateCollector`` over ``AsyncEngine.stats()``, so a dashboard reads
``omniloop_requests_waiting`` whichever front end serves the engine. Read when scraped.

The HTTP server exported three of these under other names until 2026-12; they are still
emitted there for one release (``DEPRECATED_ALIASES``), with "deprecated" in their help.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

FINISH_STATUSES = ("completed", "failed", "cancelled", "rejected")

# old HTTP name -> the name both front ends now use (removed one release after 2026-12)
DEPRECATED_ALIASES = {
    "omniloop_queue_depth": "omniloop_requests_waiting",
    "omniloop_running": "omniloop_requests_running",
    "omniloop_engine_requests": "omniloop_requests_finished",
}


class EngineStateCollector(Collector):
    """Gauges and counters of one engine, computed from ``stats()`` at scrape time.
    ``aliases=True`` also emits the deprecated HTTP names (see ``DEPRECATED_ALIASES``)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], *, aliases: bool = False) -> None:
        self._stats = stats
        self._aliases = aliases

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        metrics = [
            GaugeMetricFamily("omniloop_requests_waiting", "requests queued in the engine", value=s["waiting"]),
            GaugeMetricFamily("omniloop_requests_running", "requests holding state in the engine",
                              value=s["running"]),
            _finished("omniloop_requests_finished", "requests the engine finished, by final status (incl. warmup)", s),
            CounterMetricFamily("omniloop_engine_steps", "loop steps executed", value=s["steps"]),
            CounterMetricFamily("omniloop_engine_batched_steps", "steps that ran more than one request",
                                value=s["batched_steps"]),
            CounterMetricFamily("omniloop_engine_pool_restarts", "worker pool restarts", value=s["pool_restarts"]),
            GaugeMetricFamily("omniloop_engine_alive", "1 while the engine thread runs", value=float(s["alive"])),
            GaugeMetricFamily("omniloop_engine_accepting", "1 unless draining", value=float(s["accepting"])),
        ]
        metrics += _weights(s)
        calib = GaugeMetricFamily("omniloop_cost_model", "cost model calibration: measured/prior ratio per "
                                  "(node, kind), or EMA seconds for flop-less items", labels=["item"])
        for key, value in sorted(s["cost_model"].items()):
            calib.add_metric([key], value)
        metrics.append(calib)
        if self._aliases:
            metrics += _aliases(s)
        yield from metrics


def _weights(s: dict[str, Any]) -> list[Metric]:
    """The served weights (``update_weights``): an info gauge labelled with the version, the
    swaps so far, and the sleep level (0 awake)."""
    out: list[Metric] = [
        CounterMetricFamily("omniloop_weight_updates", "weight updates applied (update_weights)",
                            value=s.get("weight_updates", 0)),
        GaugeMetricFamily("omniloop_engine_asleep", "sleep level: 0 awake, 1 DiT/LM weights and KV released, "
                          "2 everything released", value=s.get("asleep", 0)),
    ]
    if s.get("weight_version") is not None:
        info = GaugeMetricFamily("omniloop_weight_version", "the weights served: 1, labelled with their version "
                                 "and role", labels=["version", "role"])
        info.add_metric([str(s["weight_version"]), str(s.get("weight_role") or "")], 1.0)
        out.append(info)
    return out


def _finished(name: str, help_: str, s: dict[str, Any]) -> CounterMetricFamily:
    finished = CounterMetricFamily(name, help_, labels=["status"])
    for status in FINISH_STATUSES:
        finished.add_metric([status], s[status])
    return finished


def _aliases(s: dict[str, Any]) -> list[Metric]:
    def note(old: str) -> str:
        return f"deprecated: use {DEPRECATED_ALIASES[old]} (this name goes in the next release)"

    return [
        GaugeMetricFamily("omniloop_queue_depth", note("omniloop_queue_depth"), value=s["waiting"]),
        GaugeMetricFamily("omniloop_running", note("omniloop_running"), value=s["running"]),
        _finished("omniloop_engine_requests", note("omniloop_engine_requests"), s),
    ]
