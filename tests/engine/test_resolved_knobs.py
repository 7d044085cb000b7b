"""Guidance, strength and the negative prompt resolved per node at admission (issue 28 item 1):
each active loop node's ``node_params`` carry the values that node runs with (the caller's,
else the request's, else that node's own ``GenerationDefaults``), the text stage's negative
prompt is on the resolved request when a loop guides, and the engine's queued event (what a
job reports) carries them. Nodes whose defaults differ from the pipeline's: LTX-2's refine
stage (no guidance, strength 1) and a rollout's chunk 0 (its own scale and steps)."""

from __future__ import annotations

import dataclasses

import pytest

from omniloop.engine.admission import admit
from omniloop.models.loader import load_pipeline
from omniloop.request import DiffusionParams, Modality, OmniRequest, RequestStatus, StatusEvent, TaskType, TextPart
from tests.engine.conftest import OPTS, req

V, A = Modality.VIDEO, Modality.AUDIO


def _t2v(node_params=None, **params) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a clip")], node_params=node_params or {},
                       diffusion=DiffusionParams(seed=0, **params))


def test_the_queued_event_reports_the_guidance_and_negative_prompt_used(make_engine):
    events: list = []
    engine = make_engine(events)
    engine.add_request(req(seed=1, steps=2))  # Wan's defaults: CFG 5 and its (empty) negative prompt
    engine.add_request(req(seed=2, steps=2, guidance_scale={V: 3.0}, negative_prompt="blurry"))
    engine.add_request(req(seed=3, steps=2, guidance_scale=1.0))  # unguided: no negative prompt is encoded
    queued = [e.resolved for e in events if isinstance(e, StatusEvent) and e.status is RequestStatus.QUEUED]
    assert [(r.node_params["denoise"], r.diffusion.negative_prompt) for r in queued] == [
        ({"guidance_scale": 5.0}, ""), ({"guidance_scale": {V: 3.0}}, "blurry"), ({"guidance_scale": 1.0}, None)]


def test_a_nodes_own_scale_wins_and_resolution_is_idempotent(wan_pipeline):
    request = _t2v(steps=2, height=32, width=32, num_frames=5, guidance_scale=3.0,
                   node_params={"denoise": {"guidance_scale_2": 2.0}})
    admitted = admit(wan_pipeline, request)
    assert admitted.request.node_params["denoise"] == {"guidance_scale": 3.0, "guidance_scale_2": 2.0}
    assert admit(wan_pipeline, admitted.request).request == admitted.request  # a follower or a restart re-admits it
    own = admit(wan_pipeline, _t2v(steps=2, height=32, width=32, num_frames=5, guidance_scale=3.0,
                                   node_params={"denoise": {"guidance_scale": 1.0}})).request
    assert own.node_params["denoise"] == {"guidance_scale": 1.0} and own.diffusion.negative_prompt is None


@pytest.fixture(scope="module")
def ltx2_pipeline(ltx2_dir):
    return load_pipeline(ltx2_dir, OPTS)[1]


def test_ltx2_refine_resolves_its_own_guidance_and_strength(ltx2_pipeline):
    """The refine node's defaults are its own (REFINE_DEFAULTS: no guidance, strength 1); the
    request's CFG scale and its strength reach the nodes they apply to, and no other."""
    request = _t2v(steps=2, height=64, width=64, num_frames=9, guidance_scale=4.0, strength=0.5,
                   node_params={"denoise": {"stg_blocks": [1], "audio_stg_scale": 2.0}, "upsample": {}})
    resolved = admit(ltx2_pipeline, request).request
    base, refine = resolved.node_params["denoise"], resolved.node_params["refine"]
    assert base == {"guidance_scale": {V: 4.0, A: 4.0}, "stg_scale": {V: 1.0, A: 2.0}, "audio_stg_scale": 2.0,
                    "modality_scale": {V: 3.0, A: 3.0}, "guidance_rescale": {V: 0.7, A: 0.7}, "stg_blocks": [1]}
    assert refine == {"guidance_scale": {V: 1.0, A: 1.0}, "stg_scale": {V: 0.0, A: 0.0}, "modality_scale": {V: 1.0, A: 1.0},
                      "guidance_rescale": {V: 0.0, A: 0.0}, "stg_blocks": [], "strength": 0.5}
    assert resolved.diffusion.negative_prompt == ""  # the base stage guides: LTX-2's (empty) negative prompt
    again = admit(ltx2_pipeline, resolved).request
    assert again == resolved
    own = admit(ltx2_pipeline, _t2v(steps=2, height=64, width=64, num_frames=9, node_params={"refine": {}})).request
    assert own.node_params["refine"]["strength"] == 1.0 and own.node_params["denoise"]["guidance_scale"] == {V: 3.0, A: 7.0}


def test_a_rollouts_chunk_zero_resolves_its_own_scale_and_steps(far_dir):
    """A model whose chunk 0 has its own guidance and steps (the shipped interactive model's
    defaults, here on the tiny FAR checkpoint): unset, the node's defaults; set, the caller's;
    none for a rollout conditioned on given frames."""
    from omniloop.models.families.far.spec import ROLLOUT_NODE

    far = load_pipeline(far_dir, OPTS)[1]
    far = dataclasses.replace(far, defaults=far.defaults.replace(first_chunk_guidance_scale=4.0, first_chunk_steps=3))
    size = dict(steps=2, height=32, width=64, num_frames=5)
    resolved = admit(far, _t2v(**size)).request
    assert resolved.node_params[ROLLOUT_NODE] == {"guidance_scale": 1.0, "first_chunk_guidance_scale": 4.0,
                                                  "first_chunk_steps": 3}
    assert resolved.diffusion.negative_prompt == ""  # chunk 0 guides: the negative prompt is encoded
    given = admit(far, _t2v(**size, node_params={ROLLOUT_NODE: {"first_chunk_steps": 4}})).request
    assert given.node_params[ROLLOUT_NODE]["first_chunk_steps"] == 4
    sigmas = admit(far, _t2v(sigmas=[1.0, 0.5], height=32, width=64, num_frames=5)).request
    assert "first_chunk_steps" not in sigmas.node_params[ROLLOUT_NODE]  # explicit sigmas fix every chunk's schedule
    assert admit(far, resolved).request == resolved


def test_a_loop_reads_unresolved_guidance_as_a_bug():
    from omniloop.pipeline.policies.cfg import ClassicCFG, GuidedParams

    with pytest.raises(AssertionError, match=r"resolved guidance_scale \(Stage.resolve at admission\)"):
        ClassicCFG().init(GuidedParams(), ("video",), None)
