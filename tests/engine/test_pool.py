"""The SPMD pool on 2 gloo ranks (this process is rank 0): plans broadcast and hashed on
every rank, aborts on the same channel, and a rank that dies or diverges is pool-fatal —
the engine restarts the pool and the re-queued request finishes as on one process."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.pool import PoolEngine, launch_pool_engine
from omniloop.engine.pool_messages import PlanMessage
from omniloop.request import RequestStatus
from tests.engine.conftest import req, run_all
from tests.parallel.ranks import rank_threads, threads


@pytest.fixture(scope="module")
def pool_engine(wan_t2v_dir):
    deploy = DeployConfig(device="cpu", parallel="sp=2,check_plans=1", max_batch=4)
    engine = launch_pool_engine(wan_t2v_dir, deploy)
    yield engine
    engine.close()
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def one_process(wan_pipeline):
    """Latents of the reference requests on one process."""
    engine = Engine(wan_pipeline)
    for i in range(2):
        engine.add_request(req(seed=i, steps=3, rid=f"r{i}", guidance_scale=4.0))
    outs = _run(engine)
    return {rid: out.artifacts["latents"].latents for rid, out in outs.items()}


def _run(engine):
    """Every request to its end; outputs popped, so their ids may be used again."""
    outs, _ = run_all(engine)
    for rid in list(engine._finished):
        outs[rid] = engine.pop_output(rid)
    return outs


def _latents(outs):
    return {rid: out.artifacts["latents"].latents for rid, out in outs.items() if out.status is RequestStatus.COMPLETED}


def _add_reference_requests(engine):
    for i in range(2):
        engine.add_request(req(seed=i, steps=3, rid=f"r{i}", guidance_scale=4.0))


def test_two_ranks_equal_one_with_every_plan_hashed(pool_engine, one_process):
    _add_reference_requests(pool_engine)
    outs = _run(pool_engine)
    got = _latents(outs)
    assert got.keys() == one_process.keys()
    for rid in got:  # Ulysses over 2 ranks is bit-identical (tests/parallel/test_parallel_dit.py)
        assert torch.equal(got[rid], one_process[rid]), rid
    assert pool_engine.stats.batched_steps > 0 and pool_engine.stats.pool_restarts == 0
    assert pool_engine.pool.query("requests") == [{"running": [], "waiting": [], "steps": {}}]


def test_abort_travels_with_the_plan(pool_engine):
    for rid in ("stays", "goes"):
        pool_engine.add_request(req(steps=6, rid=rid))
    with torch.inference_mode():
        while pool_engine.scheduler.running.get("goes") is None or pool_engine.scheduler.running["goes"].loop is None:
            pool_engine.step()
        pool_engine.step()
        (worker,) = pool_engine.pool.query("requests")
        assert worker["running"] == ["goes", "stays"] and worker["steps"]["goes"] >= 1
        pool_engine.abort("goes")
        pool_engine.step()
        (worker,) = pool_engine.pool.query("requests")
        assert worker["running"] == ["stays"], "rank 1 dropped the cancelled request at the same step boundary"
    outs = _run(pool_engine)
    assert outs["goes"].status is RequestStatus.CANCELLED
    assert outs["stays"].status is RequestStatus.COMPLETED


def test_a_rank_with_another_plan_is_caught_and_the_pool_restarted(pool_engine, one_process, monkeypatch):
    """Debug mode: rank 1 receives a different plan once; the hashes disagree, which is
    pool-fatal; the engine restarts the pool and re-runs the requests from scratch."""
    pool = pool_engine.pool
    real_send, tampered = pool.send, []

    def send(rank, message):
        if isinstance(message, PlanMessage) and message.plan.work is not None and not tampered:
            plan = message.plan
            message = PlanMessage(type(plan)(plan.iteration + 1, plan.admitted, plan.aborted, plan.work), message.requests,
                                  message.failed, message.check)
            tampered.append(plan.iteration)
        real_send(rank, message)

    monkeypatch.setattr(pool, "send", send)
    restarts, starts = pool_engine.stats.pool_restarts, pool.starts
    _add_reference_requests(pool_engine)
    outs = _run(pool_engine)
    assert tampered and pool_engine.stats.pool_restarts == restarts + 1 and pool.starts == starts + 1
    got = _latents(outs)
    assert all(torch.equal(got[rid], one_process[rid]) for rid in one_process)


def test_a_dead_rank_is_pool_fatal_and_requests_are_requeued(pool_engine, one_process):
    restarts = pool_engine.stats.pool_restarts
    _add_reference_requests(pool_engine)
    with torch.inference_mode():
        for _ in range(4):
            pool_engine.step()
        assert any(r.loop is not None for r in pool_engine.scheduler.running.values())
        os.kill(pool_engine.pool._procs[0].pid, signal.SIGKILL)
        pool_engine.pool._procs[0].join(timeout=10)
    outs = _run(pool_engine)
    assert pool_engine.stats.pool_restarts == restarts + 1
    got = _latents(outs)
    assert all(torch.equal(got[rid], one_process[rid]) for rid in one_process)


def test_fail_policy_fails_the_in_flight_requests(pool_engine):
    pool = pool_engine.pool
    engine = PoolEngine(pool, pool_engine.model_spec, pool_engine.pipeline,
                        EngineConfig(on_pool_failure="fail"))
    engine._finalizer.detach()  # the fixture's engine owns the pool
    engine.add_request(req(steps=4, rid="victim"))
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        pool._procs[0].join(timeout=10)
    outs = _run(engine)
    assert outs["victim"].status is RequestStatus.FAILED
    assert "worker pool failed" in outs["victim"].error and "ranks [1] died" in outs["victim"].error
    pool_engine.pipeline = engine.pipeline  # the pool was restarted under the second engine


def test_restarts_exhausted_kill_the_engine_and_stop_the_pool(pool_engine):
    """Last in this module: it leaves the shared pool stopped."""
    pool = pool_engine.pool
    engine = PoolEngine(pool, pool_engine.model_spec, pool_engine.pipeline, EngineConfig(max_pool_restarts=0))
    engine.add_request(req(steps=4, rid="last"))
    with torch.inference_mode():
        engine.step()
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        pool._procs[0].join(timeout=10)
        while engine.has_unfinished():
            engine.step()
    assert engine.dead and "pool failed 1 times" in engine.dead
    assert engine.pop_output("last").status is RequestStatus.FAILED
    assert not pool._procs and not torch.distributed.is_initialized()  # the pool was stopped with the engine
