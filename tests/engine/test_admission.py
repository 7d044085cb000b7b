"""Admission as one pass (engine/admission.py): limits -> resolve + validate -> estimate ->
``Admitted``, with the seed resolved once and typed estimates."""

import pytest

from omniloop.deploy import Limits
from omniloop.engine import DoesNotFit, LimitExceeded
from omniloop.engine.admission import Admitted, RequestEstimates, admit
from omniloop.engine.memory_budget import MemoryBudget
from omniloop.request import DiffusionParams, OmniRequest, RequestStatus, TaskType, TextPart
from tests.engine.conftest import req, run_all


def test_admit_returns_the_resolved_request_its_state_and_typed_estimates(wan_pipeline):
    admitted = admit(wan_pipeline, req(seed=7))
    assert isinstance(admitted, Admitted) and admitted.state.request is admitted.request
    assert [n.name for n in admitted.nodes] == [n.name for n in wan_pipeline.active_nodes(admitted.request)]
    assert isinstance(admitted.estimates, RequestEstimates)
    assert list(admitted.estimates.nodes) == [n.name for n in admitted.nodes]
    assert admitted.estimates.nodes["denoise"].steps == 4
    assert admitted.estimates.memory.held_bytes > 0


def test_the_seed_is_drawn_once_at_admission_and_kept(wan_pipeline):
    unseeded = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a clip")],
                           diffusion=DiffusionParams(steps=2, height=32, width=32, num_frames=5))
    admitted = admit(wan_pipeline, unseeded)
    seed = admitted.request.diffusion.seed
    assert seed is not None and admitted.request.sampling.seed is not None
    assert unseeded.diffusion.seed is None  # the user's request is not mutated
    # admitting the resolved request again (a pool follower, a restart) keeps its seed
    assert admit(wan_pipeline, admitted.request).request.diffusion.seed == seed
    assert admit(wan_pipeline, req(seed=3)).request.diffusion.seed == 3


def test_the_engine_runs_the_admitted_seed(make_engine):
    engine = make_engine()
    rid = engine.add_request(OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a clip")],
                                         diffusion=DiffusionParams(steps=2, height=32, width=32, num_frames=5)))
    seed = engine._requests[rid].request.diffusion.seed
    outs, _ = run_all(engine)
    assert outs[rid].status is RequestStatus.COMPLETED and outs[rid].metrics.seed == seed


def test_status_and_times_have_one_owner(make_engine):
    engine = make_engine()
    rid = engine.add_request(req(seed=1, steps=2))
    record = engine._requests[rid]
    assert record.status is record.state.status is RequestStatus.QUEUED and record.started is None
    run_all(engine)
    assert record.status is record.state.status is RequestStatus.COMPLETED
    assert record.started == record.state.started_at and record.finished == record.state.finished_at
    assert record.finished >= record.started


def test_limits_are_checked_on_the_models_defaults_before_the_family(wan_pipeline):
    # num_frames unset: the model's 81 frames count, refused before the family's size checks
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="x")], diffusion=DiffusionParams(steps=2))
    with pytest.raises(LimitExceeded, match=r"^diffusion.num_frames: 81 frames exceed this deployment's limit of 9"):
        admit(wan_pipeline, request, limits=Limits(max_frames=9))


def test_a_request_that_cannot_fit_alone_is_refused_naming_the_budget(wan_pipeline):
    with pytest.raises(DoesNotFit, match=r"^request needs ~.* but the memory budget is 1.0 KiB; lower the resolution"):
        admit(wan_pipeline, req(seed=0), memory=MemoryBudget(1024, max_batch=1))
