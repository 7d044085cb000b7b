"""The resolved request (issue 28 item 1) and limits on it (issue 29 item 3): admission fills
every value the loops read (steps, size, frames, fps) from the model's ``GenerationDefaults``
once, and the deployment's ceilings are checked on what would run, ``node_params`` included."""

import re

import pytest

from omniloop.deploy import Limits
from omniloop.engine import LimitExceeded
from omniloop.engine.admission import admit
from omniloop.pipeline.defaults import admitted_steps, resolve_request
from omniloop.request import DiffusionParams, OmniRequest, RequestStatus, StatusEvent, TaskType, TextPart
from tests.engine.conftest import req, run_all

LIMITS = Limits(max_steps=4, max_frames=9, max_pixels=64 * 64)


def _t2v(node_params=None, **params) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a clip")], node_params=node_params or {},
                       diffusion=DiffusionParams(seed=0, **params))


def test_admission_fills_what_the_request_leaves_unset_from_the_models_defaults(wan_pipeline):
    d = wan_pipeline.defaults  # Wan's 50 steps, 81 frames at 16 fps (its 480x832 is above the tiny DiT's RoPE)
    resolved = admit(wan_pipeline, _t2v(height=32, width=48)).request.diffusion
    assert (resolved.steps, resolved.height, resolved.width, resolved.num_frames, resolved.fps) == \
        (d.steps, 32, 48, d.num_frames, d.fps) == (50, 32, 48, 81, 16)
    image = admit(wan_pipeline, OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="x")],
                                            diffusion=DiffusionParams(seed=0, steps=2, height=32, width=32)))
    assert image.request.diffusion.num_frames == 1  # an image task's one frame, not the video default
    given = admit(wan_pipeline, req(steps=3, size=48, frames=9)).request.diffusion
    assert (given.steps, given.height, given.width, given.num_frames) == (3, 48, 48, 9)  # what it asked


def test_resolution_is_idempotent_and_explicit_sigmas_keep_the_step_count_unset(wan_pipeline):
    admitted = admit(wan_pipeline, _t2v(steps=2, height=32, width=32, num_frames=5))
    again = admit(wan_pipeline, admitted.request)  # a pool follower or a restart re-admits it
    assert again.request == admitted.request
    sigmas = admit(wan_pipeline, _t2v(sigmas=[1.0, 0.5], height=32, width=32, num_frames=5)).request.diffusion
    assert sigmas.steps is None and admitted_steps(sigmas, "denoise") == 2
    reason = OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="x")])
    assert resolve_request(reason, wan_pipeline.defaults) is reason  # no denoise loop: nothing to fill


def test_a_loop_reads_an_unresolved_request_as_a_bug_not_a_default(wan_pipeline):
    with pytest.raises(AssertionError, match=r"node 'denoise' reads diffusion.steps, which admission resolves"):
        admitted_steps(DiffusionParams(), "denoise")


def test_node_params_steps_cannot_pass_max_steps(wan_pipeline):
    request = _t2v(steps=2, height=32, width=32, num_frames=5, node_params={"denoise": {"steps": 1000}})
    with pytest.raises(LimitExceeded) as info:
        admit(wan_pipeline, request, limits=LIMITS)
    assert str(info.value) == ("node_params['denoise'].steps: 1000 steps exceed this deployment's limit of 4 "
                               "(limits.max_steps); pass fewer steps")
    assert info.value.fields == ("node_params['denoise'].steps",)
    # under the ceiling: the node's steps are what admission reports and what runs
    assert admit(wan_pipeline, _t2v(steps=2, height=32, width=32, num_frames=5, node_params={"denoise": {"steps": 3}}),
                 limits=LIMITS).steps == 3


def test_first_chunk_steps_cannot_pass_max_steps(far_dir):
    """Chunk 0's own steps are the chunk rollout's knob (node_params), checked like any node's steps."""
    import torch

    from omniloop.models.families.far.spec import ROLLOUT_NODE
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, far = load_pipeline(far_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    field = f"node_params[{ROLLOUT_NODE!r}].first_chunk_steps"
    with pytest.raises(LimitExceeded, match=rf"^{re.escape(field)}: 500 steps exceed this deployment's limit "
                                            r"of 4 \(limits.max_steps\)"):
        admit(far, _t2v(steps=2, height=32, width=64, num_frames=5,
                        node_params={ROLLOUT_NODE: {"first_chunk_steps": 500}}), limits=LIMITS)


def test_the_engine_runs_and_reports_the_node_params_steps(make_engine):
    events = []
    engine = make_engine(events)
    rid = engine.add_request(req(seed=1, steps=2).model_copy(update={"node_params": {"denoise": {"steps": 3}}}))
    queued = next(e for e in events if isinstance(e, StatusEvent) and e.status is RequestStatus.QUEUED)
    assert queued.steps == 3 and queued.resolved is not None and queued.resolved.diffusion.height == 32
    outs, _ = run_all(engine)
    assert outs[rid].status is RequestStatus.COMPLETED
    assert outs[rid].metrics.steps == 3  # the denoise loop's 3 steps, not the request's 2


def test_non_finite_numbers_are_refused_naming_the_field(wan_pipeline):
    """NaN / Infinity were accepted for guidance_scale (and any float knob): the request plane and
    the node-parameter schemas refuse them, naming the field."""
    from omniloop.request.builder import build_request

    with pytest.raises(ValueError, match=r"^diffusion.guidance_scale: Input should be a finite number"):
        build_request(TaskType.T2V, "a clip", {"guidance_scale": float("nan")})
    with pytest.raises(ValueError, match=r"^diffusion.shift: Input should be a finite number"):
        build_request(TaskType.T2V, "a clip", {"shift": float("inf")})
    request = _t2v(steps=2, height=32, width=32, num_frames=5, node_params={"denoise": {"guidance_scale": float("-inf")}})
    with pytest.raises(ValueError, match=r"node_params\['denoise'\].guidance_scale: Input should be a finite number"):
        admit(wan_pipeline, request, limits=LIMITS)
