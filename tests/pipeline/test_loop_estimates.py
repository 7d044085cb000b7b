"""The denoise and chunk loops' admission estimates, pinned: both come from one step-cost
helper (``omniloop.pipeline.loops.step_cost``), and these numbers are what the loops'
separate heuristics gave before it (tiny random Wan, FAR and LTX-2 checkpoints, CPU fp32)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.stage import WorkEstimate
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

WAN_SMALL = dict(seed=1, steps=4, height=32, width=32, num_frames=5, guidance_scale=5.0)
WAN_LARGE = dict(seed=1, steps=3, height=48, width=64, num_frames=9)
FAR = dict(seed=1, steps=2, height=32, width=64, num_frames=17)


def _estimate(path, node: str, *, cfg_mode: str = "sequential", encode: bool = False, node_params=None,
              **diffusion) -> WorkEstimate:
    pipeline = load_pipeline(path, LoadOptions(device=torch.device("cpu"), dtype=torch.float32, cfg_mode=cfg_mode))[1]
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle")],
                          diffusion=DiffusionParams(**diffusion), node_params=node_params or {})
    state = pipeline.admit(request)
    if encode:  # text embeddings present: the estimate counts their bytes as held
        with torch.inference_mode():
            pipeline.spec.node("text_encode").stage.forward(pipeline.contexts["text_encode"], state)
    return pipeline.spec.node(node).stage.estimate(pipeline.contexts[node], state)


def _numbers(e: WorkEstimate) -> tuple:
    return e.steps, e.flops_per_step, e.resident_bytes, e.peak_bytes, e.loop_bytes, e.init_peak_bytes, dict(e.pool_bytes)


@pytest.mark.parametrize("case,kw,numbers,group", [
    ("cfg sequential", dict(WAN_SMALL), (4, 6635520.0, 10240, 8704, 0, 0, {}), ((("video", (1, 16, 2, 4, 4)),), 2)),
    ("cfg batched", dict(WAN_LARGE, cfg_mode="batched", guidance_scale=5.0), (3, 13731840.0, 46080, 78336, 0, 0, {}),
     ((("video", (1, 16, 3, 6, 8)),), 2)),
    ("no cfg", dict(WAN_LARGE, guidance_scale=1.0), (3, 6865920.0, 46080, 39168, 0, 0, {}),
     ((("video", (1, 16, 3, 6, 8)),), 1)),
    ("text encoded", dict(WAN_SMALL, encode=True), (4, 6635520.0, 141312, 8704, 0, 0, {}),
     ((("video", (1, 16, 2, 4, 4)),), 2)),
])
def test_denoise_loop_estimates_are_unchanged(wan_t2v_dir, case, kw, numbers, group):
    est = _estimate(wan_t2v_dir, "denoise", **kw)
    assert _numbers(est) == numbers, case
    assert est.batch_group == group, case


def test_ltx2_loop_estimate_is_unchanged(ltx2_dir):
    est = _estimate(ltx2_dir, "denoise", seed=1, steps=2, height=64, width=64, num_frames=9)
    assert _numbers(est) == (2, 27091456.0, 4160, 0, 0, 0, {})
    assert est.batch_group == ((("audio", (1, 9, 16)), ("video", (1, 8, 8))), 4)


@pytest.mark.parametrize("case,kw,numbers,forwards", [
    ("finite", dict(FAR), (9, 4300800.0, 40960, 17408, 0, 0, {"chunk_kv": 16896}), 1),
    ("cfg batched", dict(FAR, cfg_mode="batched", steps=3, num_frames=33, guidance_scale=3.0),
     (20, 8601600.0, 57344, 34816, 0, 0, {"chunk_kv": 39936}), 2),
    ("session", dict(FAR, node_params={"rollout": {"open_ended": True, "max_chunks": 5}}),
     (15, 4300800.0, 53248, 17408, 0, 0, {"chunk_kv": 19968}), 1),
    ("text encoded", dict(FAR, guidance_scale=3.0, encode=True), (9, 8601600.0, 172032, 17408, 0, 0, {"chunk_kv": 33792}), 2),
])
def test_chunk_rollout_estimates_are_unchanged(far_dir, case, kw, numbers, forwards):
    est = _estimate(far_dir, "rollout", **kw)
    assert _numbers(est) == numbers, case
    # the shared helper's group, (latent signature, forwards); before it: ((1, 16, 2, 4, 8), forwards), which
    # grouped the same requests (the rollout's one modality)
    assert est.batch_group == ((("video", (1, 16, 2, 4, 8)),), forwards), case
