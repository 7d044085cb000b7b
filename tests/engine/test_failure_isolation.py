"""Failure isolation at every point of a batched step.

Three requests run together (steps batched, one-shot nodes grouped); one of them (seed 1)
meets a fault at one point. It alone fails, naming the fault; its two batch-mates finish
bit-identical (torch.equal) to their solo runs. Faults come through real seams (see
tests/engine/faults.py): a stage, loop, CFG policy, sampler, conditioning policy, denoiser,
LM, event consumer or observer plugin that raises for the marked request.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.ext.install import install_plugins
from omniloop.ext.plugin import PluginSpec
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import OutputSpec, RequestStatus
from tests.engine.conftest import req, run_all
from tests.engine.faults import (
    AR_POINTS,
    WAN_POINTS,
    FaultPlan,
    RaisingObserver,
    RaisingSink,
    ar_fault_pipeline,
    wan_fault_pipeline,
)
from tests.ext.factories import fake_entry_points
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import text_request

SEEDS = {"a": 0, "bad": 1, "c": 2}
STEPS = 3


def _wan_requests(**kw):
    return [req(seed, steps=STEPS, rid=rid, **kw) for rid, seed in SEEDS.items()]


def _engine(pipeline, **kw):
    return Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=3, max_running=3)), **kw)


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    return run_all(engine)[0]


@pytest.fixture(scope="module")
def wan_faults(wan_pipeline):
    plan = FaultPlan(bad_seed=SEEDS["bad"], at_step=1)
    pipeline = wan_fault_pipeline(wan_pipeline, plan)
    plan.reset(None)
    solo = {}
    for r in _wan_requests():  # the survivors' references: each request alone, no fault
        if r.request_id != "bad":
            solo[r.request_id] = _run(_engine(pipeline), [r])[r.request_id]
    return pipeline, plan, solo


def _assert_isolated(outs, solo, fault: str):
    bad = outs["bad"]
    assert bad.status is RequestStatus.FAILED and fault in bad.error, bad.error
    for rid in ("a", "c"):
        out = outs[rid]
        assert out.status is RequestStatus.COMPLETED, out.error
        assert torch.equal(out.artifacts["latents"].latents, solo[rid].artifacts["latents"].latents), rid
        assert torch.equal(out.video.frames, solo[rid].video.frames), rid


@pytest.mark.parametrize("point", WAN_POINTS)
def test_a_fault_at_one_point_fails_only_its_request(wan_faults, point):
    pipeline, plan, solo = wan_faults
    plan.reset(point)
    engine = _engine(pipeline)
    outs = _run(engine, _wan_requests())
    assert plan.fired, f"the {point} fault never fired"
    _assert_isolated(outs, solo, f"injected {point} fault")
    if point not in ("node", "forward_many", "init"):
        assert engine.stats.batched_steps >= 1  # the fault met a batched step
    assert not engine.scheduler.running and engine.scheduler.memory.reserved_bytes == 0


def test_a_batched_sampler_update_that_raises_falls_back_to_per_request_updates(wan_faults):
    """The survivors' rows of a raising batched sampler update are recomputed alone (the
    batched call changed no state), and the batched update is used again afterwards."""
    pipeline, plan, solo = wan_faults
    plan.reset("sampler")
    sampler = pipeline.components["sampler"].get(None)
    calls_before = sampler.step_many_calls
    outs = _run(_engine(pipeline), _wan_requests())
    assert plan.fired[0] == "sampler (batched)" and plan.fired[1:] == ["sampler"]  # batched, then its own
    assert sampler.step_many_calls - calls_before == STEPS  # one per step: the fallback is per step only
    _assert_isolated(outs, solo, "injected sampler fault")


def test_an_event_consumer_that_raises_fails_only_its_request(wan_faults):
    pipeline, plan, solo = wan_faults
    plan.reset(None)
    sink = RaisingSink("bad", at_step=1)
    outs = _run(_engine(pipeline, event_sink=sink), _wan_requests())
    _assert_isolated(outs, solo, "event sink failed on its progress event")
    assert [e.step for e in sink.events if e.request_id == "bad" and e.type == "progress"] == [1, 2]


def test_a_streamed_artifact_consumer_that_raises_fails_only_its_request(wan_faults):
    pipeline, plan, solo = wan_faults
    plan.reset(None)
    streamed = OutputSpec(return_latents=True, stream=True, preview_every=1)
    requests = [r if r.request_id != "bad" else r.model_copy(update={"outputs": streamed}) for r in _wan_requests()]
    outs = _run(_engine(pipeline, event_sink=RaisingSink("bad", at_step=99)), requests)
    _assert_isolated(outs, solo, "event sink failed on its artifact event")


def test_an_observer_plugin_that_raises_fails_nothing(wan_pipeline, wan_faults, monkeypatch):
    """Observers never fail the computation they watch: the raising one is logged and
    skipped, and all three requests finish as they would alone."""
    _, plan, solo = wan_faults
    observer = RaisingObserver("bad")
    fake_entry_points(monkeypatch, raising_observer=PluginSpec("raising_observer", lambda c, ctx: observer))
    pipeline = install_plugins(wan_fault_pipeline(wan_pipeline, plan), {"raising_observer": {}})
    plan.reset(None)
    outs = _run(_engine(pipeline), _wan_requests())
    assert observer.raised > 0 and outs["bad"].status is RequestStatus.COMPLETED
    for rid in ("a", "c"):
        assert torch.equal(outs[rid].artifacts["latents"].latents, solo[rid].artifacts["latents"].latents)


# -- AR decode (Qwen2) ----------------------------------------------------------------------


AR_SEEDS = {"a": 10, "bad": 11, "c": 12}


def _ar_requests():
    return [text_request(PROMPTS[i], max_tokens=8, seed=seed).model_copy(update={"request_id": rid})
            for i, (rid, seed) in enumerate(AR_SEEDS.items())]


@pytest.fixture(scope="module")
def ar_faults(qwen2_dir):
    base = load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    plan = FaultPlan(bad_seed=AR_SEEDS["bad"], at_step=2)
    pipeline = ar_fault_pipeline(base, plan)
    solo = {r.request_id: _run(_engine(pipeline), [r])[r.request_id] for r in _ar_requests() if r.request_id != "bad"}
    return pipeline, plan, solo


@pytest.mark.parametrize("point", [*AR_POINTS, "emit"])
def test_a_decode_step_fault_fails_only_its_request(ar_faults, point):
    pipeline, plan, solo = ar_faults
    plan.reset(None if point == "emit" else point)
    sink = RaisingSink("bad", at_step=plan.at_step) if point == "emit" else None
    engine = _engine(pipeline, event_sink=sink)
    outs = _run(engine, _ar_requests())
    bad = outs["bad"]
    fault = "event sink failed" if point == "emit" else f"injected {point} fault"
    assert bad.status is RequestStatus.FAILED and fault in bad.error, bad.error
    assert engine.stats.batched_steps >= 1
    for rid in ("a", "c"):
        assert outs[rid].status is RequestStatus.COMPLETED, outs[rid].error
        assert outs[rid].text.token_ids == solo[rid].text.token_ids and outs[rid].text.text == solo[rid].text.text
    assert engine.scheduler.memory.reserved_bytes == 0
