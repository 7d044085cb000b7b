"""StepScheduler unit tests on fake stages and scripted requests (no checkpoint, no model), in
the style of vLLM's tests/v1/core/test_scheduler.py: build a scheduler, add requests, read its
plans. The last tests run the real Engine on the same fake pipeline for what it does with a
plan (a failing request in a batch, finish bookkeeping, cancellation)."""

from __future__ import annotations

import pytest

from omniloop.engine.scheduler import NodeWork, StepWork
from omniloop.request import RequestStatus
from tests.engine.fake_stages import (
    DEVICE_FLOPS,
    FLOPS_PER_PIXEL,
    PEAK_BYTES_PER_PIXEL,
    STATE_BYTES_PER_PIXEL,
    create_engine,
    create_pipeline,
    create_request,
    create_requests,
    create_scheduler,
    run_plan,
    run_to_completion,
)

STEP_32 = 32 * 32 * FLOPS_PER_PIXEL / DEVICE_FLOPS  # predicted seconds of one 32x32 step (uncalibrated)


def _into_loop(scheduler, pipeline, reqs) -> None:
    """Add ``reqs`` and run plans until every one has entered its loop (or finished)."""
    for r in reqs:
        scheduler.add(r)
    for _ in range(100):
        if all(r.loop is not None or r.node is None for r in reqs):
            return
        run_plan(scheduler, pipeline, scheduler.schedule())
    raise AssertionError("requests did not enter their loop in 100 plans")


# -- interleaving --------------------------------------------------------------------------


def test_a_short_request_overtakes_a_long_one_between_its_steps():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    scheduler.add(create_requests(pipeline, 1, prefix="long", steps=6)[0])
    for _ in range(4):  # encode, init, 2 steps
        run_plan(scheduler, pipeline, scheduler.schedule())
    scheduler.add(create_requests(pipeline, 1, prefix="short", steps=2, arrival=1.0)[0])
    assert run_to_completion(scheduler, pipeline) == ["short0", "long0"]
    assert calls.log == [
        ("encode", ("long0",)), ("loop.init", ("long0",)), ("loop", ("long0",)), ("loop", ("long0",)),
        # the newcomer's prologue, then its 2 steps (2 left vs long's 4), then long resumes
        ("encode", ("short0",)), ("loop.init", ("short0",)), ("loop", ("short0",)), ("loop", ("short0",)),
        *[("loop", ("long0",))] * 4,
    ]


def test_fifo_runs_requests_to_completion_in_arrival_order():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(kind="fifo", max_running=1)
    scheduler.add(create_requests(pipeline, 1, prefix="long", steps=8)[0])
    scheduler.add(create_requests(pipeline, 1, prefix="short", steps=1, arrival=1.0)[0])
    assert run_to_completion(scheduler, pipeline) == ["long0", "short0"]


def test_requests_at_one_node_enter_their_loop_together():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=8)
    for r in create_requests(pipeline, 3, steps=2):
        scheduler.add(r)
    plans = [scheduler.schedule()]
    assert plans[0].admitted == ("r0", "r1", "r2") and plans[0].work == NodeWork("encode", ("r0", "r1", "r2"))
    run_plan(scheduler, pipeline, plans[0])
    assert scheduler.schedule().work == NodeWork("loop", ("r0", "r1", "r2"))  # every init in one iteration


# -- batching ------------------------------------------------------------------------------


def test_compatible_steps_batch_and_incompatible_ones_do_not():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=8)
    same = create_requests(pipeline, 3, steps=3)
    other = create_requests(pipeline, 1, prefix="wide", steps=3, shape=(32, 64), arrival=1.0)
    _into_loop(scheduler, pipeline, same + other)
    keys = {r.request_id: r.node.stage.batch_key(r.loop) for r in same + other}
    assert keys["r0"] == keys["r1"] == keys["r2"] != keys["wide0"]
    run_to_completion(scheduler, pipeline)
    assert sorted(calls.steps()) == sorted([("r0", "r1", "r2")] * 3 + [("wide0",)] * 3)


def test_max_batch_caps_a_batch_and_the_rest_step_next():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=2)
    _into_loop(scheduler, pipeline, create_requests(pipeline, 3, steps=1))
    run_to_completion(scheduler, pipeline)
    assert calls.steps() == [("r0", "r1"), ("r2",)]


def test_the_token_budget_leaves_out_what_does_not_fit_and_takes_a_smaller_one_further_down():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=8, max_batch_tokens=2 * 32 * 32)  # FakeLoop weighs a step by pixels
    reqs = create_requests(pipeline, 3, steps=1)
    _into_loop(scheduler, pipeline, reqs)
    plan = scheduler.schedule()
    assert plan.work == StepWork("loop", ("r0", "r1"))  # a third 32x32 step would exceed 2048 tokens


def test_a_loop_that_cannot_step_yet_is_passed_over_and_resumes_when_ready():
    pipeline, calls = create_pipeline()
    stage = pipeline.spec.node("loop").stage
    scheduler = create_scheduler(max_batch=8)
    reqs = create_requests(pipeline, 2, steps=2)
    _into_loop(scheduler, pipeline, reqs)
    stage.waiting.add("r0")  # e.g. waiting for KV blocks
    plan = scheduler.schedule()
    assert plan.work == StepWork("loop", ("r1",))
    run_plan(scheduler, pipeline, plan)
    stage.waiting.clear()
    assert run_to_completion(scheduler, pipeline)[-1] == "r0"
    assert calls.steps() == [("r1",), ("r1", "r0"), ("r0",)]  # r1, with less left, leads the batch


# -- priorities and deadlines ----------------------------------------------------------------


def test_a_higher_priority_request_preempts_at_the_next_step_boundary():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    low = create_requests(pipeline, 1, prefix="low", steps=3)[0]
    _into_loop(scheduler, pipeline, [low])
    run_plan(scheduler, pipeline, scheduler.schedule())  # low's first step
    scheduler.add(create_requests(pipeline, 1, prefix="high", steps=5, priority=5, arrival=1.0)[0])
    assert run_to_completion(scheduler, pipeline) == ["high0", "low0"]
    assert calls.steps() == [("low0",), *[("high0",)] * 5, *[("low0",)] * 2]


def test_a_request_whose_deadline_is_at_risk_ranks_before_a_shorter_one():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    # arrival 0.0 is long past on the perf_counter clock: any deadline is at risk
    urgent = create_requests(pipeline, 1, prefix="urgent", steps=8, deadline_s=1.0)[0]
    short = create_requests(pipeline, 1, prefix="short", steps=1)[0]
    _into_loop(scheduler, pipeline, [urgent, short])
    assert scheduler.schedule().work == StepWork("loop", ("urgent0",))


def test_priority_outranks_a_deadline():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    urgent = create_requests(pipeline, 1, prefix="urgent", steps=1, deadline_s=1.0)[0]
    vip = create_requests(pipeline, 1, prefix="vip", steps=8, priority=1)[0]
    _into_loop(scheduler, pipeline, [urgent, vip])
    assert scheduler.schedule().work == StepWork("loop", ("vip0",))


# -- cancellation --------------------------------------------------------------------------


def test_cancellation_takes_effect_at_the_next_step_boundary():
    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=8)
    reqs = create_requests(pipeline, 2, steps=5)
    waiting = create_requests(pipeline, 1, prefix="queued", steps=5, arrival=1.0)[0]
    _into_loop(scheduler, pipeline, reqs)
    run_plan(scheduler, pipeline, scheduler.schedule())
    reqs[1].abort_requested = True
    scheduler.add(waiting)
    waiting.abort_requested = True  # cancelled before it ever ran
    plan = scheduler.schedule()
    assert set(plan.aborted) == {"r1", "queued0"} and plan.admitted == ()
    assert plan.work == StepWork("loop", ("r0",))  # the aborted one is out of the batch
    run_plan(scheduler, pipeline, plan)
    run_to_completion(scheduler, pipeline)
    assert sum("r1" in ids for ids in calls.steps()) == 1 and not any("queued0" in ids for _, ids in calls.log)


# -- budget and cost -----------------------------------------------------------------------


def test_memory_admission_starts_what_fits_and_the_rest_waits_for_room():
    pipeline, _ = create_pipeline()
    per_request = 32 * 32 * (STATE_BYTES_PER_PIXEL + PEAK_BYTES_PER_PIXEL)  # held + its share of a batched step
    scheduler = create_scheduler(max_batch=8, budget_bytes=2 * per_request)
    for r in create_requests(pipeline, 3, steps=2):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert plan.admitted == ("r0", "r1")  # a third would not fit: its state and a step of three
    finished = run_plan(scheduler, pipeline, plan)
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        if "r2" in plan.admitted:
            assert finished, "r2 started before a running request finished"
        finished += run_plan(scheduler, pipeline, plan)
    assert sorted(finished) == ["r0", "r1", "r2"]


def test_max_running_bounds_the_requests_holding_state():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_running=2)
    for r in create_requests(pipeline, 3, steps=2):
        scheduler.add(r)
    assert scheduler.schedule().admitted == ("r0", "r1") and [r.request_id for r in scheduler.waiting] == ["r2"]


def test_plans_predict_their_cost_and_remaining_cost_counts_steps_left():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_batch=8)
    reqs = create_requests(pipeline, 2, steps=4)
    _into_loop(scheduler, pipeline, reqs)
    plan = scheduler.schedule()
    assert plan.work == StepWork("loop", ("r0", "r1"))
    assert plan.predicted_s == pytest.approx(2 * STEP_32)  # a batch predicts the sum of its requests' steps
    assert scheduler.remaining_s(reqs[0]) == pytest.approx(4 * STEP_32)
    run_plan(scheduler, pipeline, plan)
    assert scheduler.remaining_s(reqs[0]) == pytest.approx(3 * STEP_32)


def test_cheap_prologue_work_runs_before_the_heads_step():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    head = create_requests(pipeline, 1, prefix="head", steps=3)[0]
    _into_loop(scheduler, pipeline, [head])
    scheduler.cost_model.observe(scheduler.item_cost(head), 1.0)  # the head's steps: 1 s each
    scheduler.add(create_requests(pipeline, 1, prefix="new", steps=30, arrival=1.0)[0])
    plan = scheduler.schedule()  # the newcomer's encode (0.01 s prior) is cheap next to a 1 s step
    assert plan.work == NodeWork("encode", ("new0",))


def test_costly_prologue_work_interleaves_one_item_per_head_step():
    pipeline, _ = create_pipeline()
    scheduler = create_scheduler(max_batch=1)
    head = create_requests(pipeline, 1, prefix="head", steps=6)[0]
    _into_loop(scheduler, pipeline, [head])
    scheduler.add(create_requests(pipeline, 1, prefix="new", steps=30, arrival=1.0)[0])
    works = []
    for _ in range(5):  # the encode's 0.01 s prior is 10x the head's 1 ms step
        plan = scheduler.schedule()
        works.append(plan.work)
        run_plan(scheduler, pipeline, plan)
    head_step = StepWork("loop", ("head0",))
    assert works == [head_step, NodeWork("encode", ("new0",)), head_step, NodeWork("loop", ("new0",)), head_step]


# -- what the engine does with a plan ------------------------------------------------------


def test_a_failing_request_in_a_batch_fails_alone_and_its_batch_mates_finish():
    pipeline, calls = create_pipeline(fail={"r1": 1})  # r1's second step fails
    engine = create_engine(pipeline, max_batch=4)
    for i in range(3):
        engine.add_request(create_request(f"r{i}", steps=3))
    outs = _run(engine)
    assert outs["r1"].status is RequestStatus.FAILED and "scripted failure of r1" in outs["r1"].error
    for rid in ("r0", "r2"):
        assert outs[rid].status is RequestStatus.COMPLETED
        assert outs[rid].artifacts["latents"].tensor.item() == 3.0  # all their steps ran
    assert calls.steps() == [("r0", "r1", "r2"), ("r0", "r1", "r2"), ("r0", "r2")]
    assert (engine.stats.completed, engine.stats.failed) == (2, 1)


def test_finish_bookkeeping_frees_everything_and_records_metrics():
    pipeline, _ = create_pipeline()
    engine = create_engine(pipeline, max_batch=4)
    for i in range(2):
        engine.add_request(create_request(f"r{i}", steps=2 + i))
    outs = _run(engine, pop=False)
    assert engine.num_running() == 0 and engine.num_waiting() == 0 and not engine.has_unfinished()
    assert engine.scheduler.memory.reserved_bytes == 0  # every reservation released
    for i, rid in enumerate(("r0", "r1")):
        out = outs[rid]
        assert out.status is RequestStatus.COMPLETED and out.metrics.steps == 2 + i
        assert out.metrics.run_s >= 0 and out.metrics.queue_s >= 0 and out.metrics.predicted_cost_s > 0
        assert engine.is_tracked(rid)  # until popped
        assert engine.pop_output(rid) is out and not engine.is_tracked(rid)
    assert (engine.stats.completed, engine.stats.steps) == (2, 3)  # 2 batched steps, then r1's last alone


def test_a_cancelled_request_stops_at_a_step_boundary_and_is_counted():
    pipeline, calls = create_pipeline()
    engine = create_engine(pipeline, max_batch=4)
    engine.add_request(create_request("victim", steps=10))
    engine.add_request(create_request("other", steps=4))
    while sum("victim" in ids for ids in calls.steps()) < 2:
        engine.step()
    engine.abort("victim")
    outs = _run(engine)
    assert outs["victim"].status is RequestStatus.CANCELLED and outs["other"].status is RequestStatus.COMPLETED
    assert sum("victim" in ids for ids in calls.steps()) == 2  # no step after the abort
    assert engine.stats.cancelled == 1 and engine.scheduler.memory.reserved_bytes == 0


def _run(engine, pop: bool = True) -> dict:
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    if pop:
        for rid in list(outs):
            engine.pop_output(rid)
    return outs
