"""Mixed resolutions in one step: Flux requests of different sizes and aspect ratios denoise
in the same forward (their token sequences packed, attention per sample, per-sample RoPE
ids, timesteps and guidance), under the scheduler's token budget; resolution buckets as a
deploy option.

Tolerance: each packed request's final latents equal its solo run within 2e-6 (fp32 CPU;
measured <= 9.6e-7: the packed GEMMs run over more rows, which changes the kernels'
blocking; attention, RoPE, modulation and the sampler step are per sample)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.errors import RequestRejected
from omniloop.models.families.flux.model import FluxInputs
from omniloop.models.layers.packed import Segments
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import run_recorded

TOL = 2e-6
SIZES = [(32, 48), (48, 32), (32, 32), (64, 16), (32, 48)]  # (height, width): landscape, portrait, square, tall


@pytest.fixture(scope="module")
def flux_pipeline(flux_dir):
    return load_pipeline(flux_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]


def _req(i: int, h: int, w: int, steps: int = 3, **params) -> OmniRequest:
    return OmniRequest(request_id=f"r{i}", task=TaskType.T2I, inputs=[TextPart(text=f"a shape number {i}")],
                       diffusion=DiffusionParams(height=h, width=w, steps=steps, seed=i, guidance_scale=2.0 + i, **params),
                       outputs=OutputSpec(return_latents=True))


def _run(pipeline, reqs, **policy):
    outs, plans = run_recorded(pipeline, reqs, **policy)
    return outs, plans.steps()


def _latents(out):
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def test_requests_of_different_sizes_share_every_step_and_equal_their_solo_runs(flux_pipeline):
    reqs = [_req(i, h, w) for i, (h, w) in enumerate(SIZES)]
    outs, steps = _run(flux_pipeline, reqs, max_batch=8, max_running=8)
    assert [len(s.request_ids) for s in steps] == [5, 5, 5]  # all five sizes in each of the 3 steps
    for r, (h, w) in zip(reqs, SIZES):
        packed = _latents(outs[r.request_id])
        assert packed.shape == (1, 4, h // 8, w // 8)
        solo = _latents(_run(flux_pipeline, [r])[0][r.request_id])
        assert (packed - solo).abs().max().item() <= TOL


def test_admission_predicts_that_packed_requests_of_any_size_share_a_step(flux_pipeline):
    """The estimate's batch group is made like the live batch key: requests of every size are
    one group (their step activations stack), as their steps are one batch."""
    node, ctx = flux_pipeline.spec.node("denoise"), flux_pipeline.contexts["denoise"]
    groups = {node.stage.estimate(ctx, flux_pipeline.admit(_req(i, h, w))).batch_group for i, (h, w) in enumerate(SIZES)}
    assert len(groups) == 1


def test_the_token_budget_bounds_each_batch(flux_pipeline):
    reqs = [_req(i, h, w) for i, (h, w) in enumerate(SIZES)]
    per_request = {f"r{i}": 512 + (h // 16) * (w // 16) for i, (h, w) in enumerate(SIZES)}  # T5 + image tokens
    budget = 1100  # two requests
    outs, steps = _run(flux_pipeline, reqs, max_batch=8, max_running=8, max_batch_tokens=budget)
    assert all(sum(per_request[r] for r in s.request_ids) <= budget for s in steps)
    assert max(len(s.request_ids) for s in steps) == 2 and len(steps) > 3
    assert all(o.status.value == "completed" for o in outs.values())


def test_packed_forward_of_three_samples_equals_each_alone(flux_pipeline):
    model = flux_pipeline.components["transformer"]
    g = torch.Generator().manual_seed(0)
    grids, text_lens = [(2, 3), (3, 2), (1, 4)], [5, 7, 5]
    samples = []
    for (gh, gw), lt in zip(grids, text_lens):
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(gh)), torch.arange(float(gw)),
                                         indexing="ij"), -1).reshape(-1, 3)
        samples.append(dict(image=torch.randn(gh * gw, 16, generator=g), text=torch.randn(lt, 32, generator=g),
                            pooled=torch.randn(1, 24, generator=g), timestep=torch.rand(1, generator=g),
                            guidance=torch.tensor([3.5]), image_ids=ids, text_ids=torch.zeros(lt, 3)))

    def inputs(parts):
        return FluxInputs(
            image=torch.cat([p["image"] for p in parts]), text=torch.cat([p["text"] for p in parts]),
            pooled=torch.cat([p["pooled"] for p in parts]), timestep=torch.cat([p["timestep"] for p in parts]),
            guidance=torch.cat([p["guidance"] for p in parts]), image_ids=torch.cat([p["image_ids"] for p in parts]),
            text_ids=torch.cat([p["text_ids"] for p in parts]),
            image_segments=Segments(tuple(p["image"].shape[0] for p in parts)),
            text_segments=Segments(tuple(p["text"].shape[0] for p in parts)))

    with torch.no_grad():
        packed = model(inputs(samples)).split([p["image"].shape[0] for p in samples])
        for part, sample in zip(packed, samples):
            assert (part - model(inputs([sample]))).abs().max().item() <= TOL


def test_resolution_buckets_admit_only_their_sizes_and_batch_each_bucket_unpacked(flux_dir):
    pipeline = load_pipeline(flux_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32,
                                                   resolution_buckets=((32, 48), (32, 32))))[1]
    engine = Engine(pipeline, EngineConfig())
    with pytest.raises(RequestRejected, match=r"size 16x64 is not one of this deployment's resolution buckets "
                                              r"\['48x32', '32x32'\]; pass one of them"):
        engine.add_request(_req(9, 64, 16))
    reqs = [_req(0, 32, 48), _req(1, 32, 32), _req(2, 32, 48)]
    outs, steps = _run(pipeline, reqs, max_batch=8, max_running=8)
    batches = sorted({tuple(sorted(s.request_ids)) for s in steps})
    assert batches == [("r0", "r2"), ("r1",)]  # same-bucket requests batch, buckets do not mix
    assert all(o.status.value == "completed" for o in outs.values())
