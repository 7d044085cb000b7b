"""Admission that knows batching: a step's peak is its batch's, an AR loop reserves its KV
growth and frees it when it stops, and a request that can never fit is a 413 naming both
numbers."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import DoesNotFit, Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.memory_budget import MemoryBudget, MemoryEstimate, step_peak_bytes
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.stage import WorkEstimate
from omniloop.request import ErrorKind, RequestStatus
from tests.engine.conftest import req, run_all
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import text_request, with_defaults

MiB = 1 << 20


def _est(held=0, peak=0, group="g", loop=0, init=0):
    return MemoryEstimate.of_nodes({"denoise": WorkEstimate(resident_bytes=held, peak_bytes=peak, batch_group=group,
                                                            loop_bytes=loop, init_peak_bytes=init)})


def test_a_steps_peak_is_its_batchs_not_the_largest_request():
    ests = [_est(peak=p) for p in (5, 3, 4, 1)]
    assert step_peak_bytes(ests, max_batch=1) == 5  # unbatched: the largest single step
    assert step_peak_bytes(ests, max_batch=3) == 5 + 4 + 3  # the 3 largest that may batch together
    mixed = [_est(peak=5, group="a"), _est(peak=5, group="b"), _est(peak=2, group="a")]
    assert step_peak_bytes(mixed, max_batch=8) == 7  # different shapes never share a step
    assert step_peak_bytes([_est(peak=1, init=9), _est(peak=1)], max_batch=8) == 9  # an init runs alone
    alone = [_est(peak=5, group=None), _est(peak=4, group=None)]  # no predicted key: each step runs alone
    assert step_peak_bytes(alone, max_batch=8) == 5


def test_can_start_counts_max_batch_co_batched_requests():
    for max_batch, admitted in ((1, 4), (2, 3), (3, 2)):
        budget = MemoryBudget(10 * 3 + 40 * 2, max_batch=max_batch)  # 3 states + 2 steps' activations
        n = 0
        while n < 4 and budget.can_start(_est(held=10, peak=40)):
            budget.reserve(f"r{n}", _est(held=10, peak=40))
            n += 1
        assert n == admitted, (max_batch, n)


def test_a_loops_bytes_are_released_when_the_loop_ends():
    budget = MemoryBudget(100, max_batch=1)
    budget.reserve("ar", _est(held=5, loop=60, peak=10))
    assert budget.reserved_bytes == 65 and not budget.can_start(_est(held=30, peak=10))
    budget.release_loop("ar", "denoise")
    assert budget.reserved_bytes == 5 and budget.can_start(_est(held=30, peak=10))


def test_admission_waits_for_room_for_a_batched_step(make_engine):
    """Two requests whose states fit together: with max_batch=1 both run at once (their steps
    never stack), with max_batch=2 the second waits (a step of both would not fit)."""
    probe = make_engine()
    probe.add_request(req(1, steps=2, rid="probe"))
    mem = probe._requests["probe"].memory
    budget = 2 * mem.held_bytes + mem.peak_bytes + mem.peak_bytes // 2
    for max_batch, running in ((1, ["first", "second"]), (2, ["first"])):
        engine = make_engine(memory_budget_bytes=budget, max_batch=max_batch)
        engine.add_request(req(1, steps=3, rid="first"))
        engine.add_request(req(2, steps=3, rid="second"))
        with torch.inference_mode():
            engine.step()
        assert sorted(engine.scheduler.running) == running, max_batch
        outs, _ = run_all(engine)
        assert all(o.status is RequestStatus.COMPLETED for o in outs.values())


def test_a_request_that_can_never_fit_is_refused_at_submission_naming_both_numbers(make_engine):
    engine = make_engine(memory_budget_bytes=1 * MiB)
    with pytest.raises(DoesNotFit) as info:
        engine.add_request(req(3, steps=3, size=256, frames=17))
    message = str(info.value)
    assert "memory budget is 1.0 MiB" in message and "request needs ~2.9 MiB" in message
    # its kind is what the HTTP front end answers 413 for (tests/test_error_kinds.py pins the mapping)
    assert info.value.kind is ErrorKind.DOES_NOT_FIT and engine.stats.rejected == 1 and not engine.tracked_ids()


@pytest.fixture(scope="module")
def qwen2(qwen2_dir):
    return load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]


def test_an_ar_loop_reserves_its_kv_growth_and_frees_it_on_an_early_stop(qwen2):
    lm = qwen2.components["lm"]
    engine = Engine(qwen2, EngineConfig())
    engine.add_request(text_request(PROMPTS[1], max_tokens=40).model_copy(update={"request_id": "long"}))
    est = engine._requests["long"].estimates.nodes["decode"]
    prompt = len(qwen2.components["tokenizer"].encode(PROMPTS[1]))
    per_token = lm.kv_layout.bytes_per_token(torch.float32)
    block = qwen2.components["text_kv"].block_size  # paged text KV: whole blocks
    assert est.loop_bytes >= (prompt + 40) * per_token and est.loop_bytes % (block * per_token) == 0
    with torch.inference_mode():
        engine.step(), engine.step()  # admitted; init (prefill)
        assert engine.scheduler.memory.reserved_bytes == est.loop_bytes  # reserved at start
        loop = engine.scheduler.running["long"].loop
        while engine.has_unfinished():
            engine.step()
            if loop.kv.nbytes:
                assert loop.kv.nbytes <= est.loop_bytes  # the estimate bounds what it allocates
    assert engine.scheduler.memory.reserved_bytes == 0

    # a budget with room for one request's KV: the second waits until the first stops (EOS)
    greedy = engine.pop_output("long").text.token_ids
    eos = greedy[3]
    stops = with_defaults(qwen2, eos_token_ids=(eos,))
    one = Engine(stops, EngineConfig(policy=SchedulingPolicy(max_batch=2)))
    one.add_request(text_request(PROMPTS[1], max_tokens=40).model_copy(update={"request_id": "probe"}))
    need = one._requests["probe"].memory.alone_bytes
    engine = Engine(stops, EngineConfig(memory_budget_bytes=need + need // 3, policy=SchedulingPolicy(max_batch=2)))
    for rid in ("first", "second"):
        engine.add_request(text_request(PROMPTS[1], max_tokens=40).model_copy(update={"request_id": rid}))
    with torch.inference_mode():
        engine.step()
    assert list(engine.scheduler.running) == ["first"]  # its KV reservation leaves no room
    outs, _ = run_all(engine)
    first = outs["first"].text.token_ids
    assert len(first) == greedy.index(eos) + 1 < 40  # stopped early, at the EOS
    assert outs["second"].text.token_ids == first and engine.scheduler.memory.reserved_bytes == 0
