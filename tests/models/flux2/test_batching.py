"""FLUX.2 requests in the engine: same-size requests (text-to-image, edits with equal
reference grids) share batched steps and each equals its solo run; other sizes run apart
(a batched forward shares its position ids); bad input is refused at admission by field.

Tolerance: batched vs solo final latents within 2e-6 (fp32 CPU; the batched GEMMs run over
more rows, which changes the kernels' blocking); measured below in the assertion's comment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.errors import RequestRejected
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import run_recorded

TOL = 2e-6


@pytest.fixture(scope="module")
def klein(klein_dir):
    return load_pipeline(klein_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]


def _picture(seed: int, h: int = 64, w: int = 64):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _req(i: int, h: int = 32, w: int = 48, refs=(), **params) -> OmniRequest:
    task = TaskType.I2I if refs else TaskType.T2I
    return OmniRequest(request_id=f"r{i}", task=task, inputs=[TextPart(text=f"a shape number {i}"), *refs],
                       diffusion=DiffusionParams(height=h, width=w, steps=2, seed=i, **params),
                       outputs=OutputSpec(return_latents=True))


def _run(pipeline, reqs):
    outs, plans = run_recorded(pipeline, reqs, max_batch=8, max_running=8)
    return outs, plans.steps()


def _latents(out):
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def test_same_size_requests_share_steps_and_equal_their_solo_runs(klein):
    ref = [ImagePart(data=_picture(0))]
    reqs = [_req(0), _req(1), _req(2, h=48, w=32), _req(3, refs=ref), _req(4, refs=[ImagePart(data=_picture(1))])]
    outs, steps = _run(klein, reqs)
    # two t2i of 32x48 together, the edits (equal 4x4 reference grids) together, the 48x32 alone
    groups = [sorted(s.request_ids) for s in steps]
    assert sorted(groups) == [["r0", "r1"]] * 2 + [["r2"]] * 2 + [["r3", "r4"]] * 2  # each of 2 steps
    for r in (reqs[0], reqs[3]):  # a t2i and an edit, each against its solo run
        solo = _latents(_run(klein, [r])[0][r.request_id])
        assert (_latents(outs[r.request_id]) - solo).abs().max() <= TOL  # measured <= 4.8e-7


@pytest.mark.parametrize("request_, field", [
    (_req(0, h=40), "diffusion.height"),
    (_req(0, guidance_scale=4.0), "diffusion.guidance_scale"),  # the distilled klein runs without CFG
    (_req(0, negative_prompt="blurry"), "diffusion.negative_prompt"),
    (_req(0, refs=[ImagePart(data=_picture(0))], strength=0.5), "diffusion.strength"),
    (_req(0, refs=[ImagePart(data=_picture(0, 32, 32))]), "image"),  # below 64 px
    (OmniRequest(task=TaskType.I2I, inputs=[TextPart(text="x")]), "image"),
    (OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="x"), ImagePart(data=_picture(0))]), "inputs"),
])
def test_bad_requests_are_refused_at_admission_naming_the_field(klein, request_, field):
    engine = Engine(klein, EngineConfig())
    with pytest.raises(RequestRejected) as e:
        engine.add_request(request_)
    assert field in e.value.fields, (e.value, e.value.fields)
