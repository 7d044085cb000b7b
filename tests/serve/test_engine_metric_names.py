"""The HTTP server and the Dynamo worker export the engine's state under one set of names."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from omniloop.serve.dynamo.metrics import WorkerMetrics
from omniloop.serve.engine_metrics import DEPRECATED_ALIASES
from omniloop.serve.metrics import ServeMetrics

STATS = {"waiting": 3, "running": 2, "completed": 5, "failed": 1, "cancelled": 0, "rejected": 4, "steps": 40,
         "batched_steps": 9, "pool_restarts": 0, "alive": True, "accepting": True, "cost_model": {"denoise/step": 1.1}}
ENGINE_STATE = {"omniloop_requests_waiting", "omniloop_requests_running", "omniloop_requests_finished",
                "omniloop_engine_steps", "omniloop_engine_batched_steps", "omniloop_engine_pool_restarts",
                "omniloop_engine_alive", "omniloop_engine_accepting", "omniloop_cost_model"}


def names(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


def worker_registry() -> CollectorRegistry:
    return WorkerMetrics(SimpleNamespace(stats=lambda: STATS)).registry  # type: ignore[arg-type]


def test_http_and_dynamo_export_the_same_engine_state_names():
    http, worker = names(ServeMetrics(lambda: STATS).registry), names(worker_registry())
    assert ENGINE_STATE <= http and ENGINE_STATE <= worker
    assert {"omniloop_request_predicted_cost_seconds", "omniloop_request_actual_cost_seconds"} <= http & worker


def test_values_agree_and_old_http_names_are_deprecated_aliases():
    registry = ServeMetrics(lambda: STATS).registry
    assert registry.get_sample_value("omniloop_requests_waiting") == 3
    assert registry.get_sample_value("omniloop_requests_finished_total", {"status": "rejected"}) == 4
    assert registry.get_sample_value("omniloop_queue_depth") == 3
    assert registry.get_sample_value("omniloop_engine_requests_total", {"status": "rejected"}) == 4
    helps = {family.name: family.documentation for family in registry.collect()}
    for old, new in DEPRECATED_ALIASES.items():
        assert helps[old].startswith(f"deprecated: use {new}")
    assert worker_registry().get_sample_value("omniloop_queue_depth") is None  # the worker never had the old names
