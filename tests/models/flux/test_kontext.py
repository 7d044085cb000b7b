"""FLUX.1 Kontext parity against diffusers' ``FluxKontextPipeline`` on a tiny random
Kontext folder (built and saved with diffusers; fp32, CPU, same seed): the reference image
resized to its Kontext resolution, VAE-encoded (posterior mean), packed as tokens with
position ids (1, row, col) beside the noisy tokens; only their prediction is kept.

Measured: bit-exact (torch.equal) solo. Requests of different output and reference sizes
packed into one forward equal diffusers within 2e-6 (measured <= 6.0e-7; the packed GEMMs'
blocking, as tests/models/flux/test_packing.py).

The preferred Kontext resolutions (672..1568 px) are swapped for small ones in both
implementations (the same list in both), so the reference stays a few tokens on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.engine.errors import RequestRejected
from omniloop.models.families.flux import kontext
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, ImagePart, LatentPart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import run_recorded
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

SMALL = [(32, 64), (48, 48), (64, 32)]  # (width, height), multiples of 16
TOL = 2e-6


@pytest.fixture(autouse=True)
def small_resolutions(monkeypatch):
    import diffusers.pipelines.flux.pipeline_flux_kontext as ref

    monkeypatch.setattr(ref, "PREFERRED_KONTEXT_RESOLUTIONS", SMALL)
    monkeypatch.setattr(kontext, "KONTEXT_RESOLUTIONS", SMALL)


def _image(w: int, h: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _request(image, h=None, w=None, seed=5, steps=3, rid="k0", prompt=PROMPT, **params):
    part = ImagePart(data=image, role="reference") if not isinstance(image, torch.Tensor) else LatentPart(data=image, of="image")
    return OmniRequest(request_id=rid, task=TaskType.I2I, inputs=[TextPart(text=prompt), part],
                       diffusion=DiffusionParams(height=h, width=w, steps=steps, seed=seed, guidance_scale=2.5, **params),
                       outputs=OutputSpec(return_latents=True))


def _diffusers(folder, image, h, w, seed=5, steps=3, prompt=PROMPT):
    pipe = diffusers_pipeline(folder, "FluxKontextPipeline")
    # max_area = h * w: diffusers keeps the asked size (it rescales any size to max_area's area)
    return diffusers_latents(pipe, h, w, seed, prompt=prompt, image=image, num_inference_steps=steps,
                             guidance_scale=2.5, max_area=h * w)


def test_kontext_folder_loads_as_an_edit_only_flux_variant(flux_kontext_dir):
    spec, pipeline = load_pipeline(flux_kontext_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    assert pipeline.spec.name == "flux.1-kontext" and pipeline.spec.tasks == frozenset({TaskType.I2I})


def test_edit_equals_flux_kontext_pipeline(flux_kontext_dir):
    image = _image(50, 30)  # floored to 48x16 (aspect 3): the nearest Kontext size is 64x32
    out = generator(flux_kontext_dir).generate(_request(image, 32, 48))
    assert out.status.value == "completed", out.error
    assert torch.equal(out.artifacts["latents"].latents, _diffusers(flux_kontext_dir, image, 32, 48))


def test_edit_without_a_size_takes_the_references_kontext_size(flux_kontext_dir):
    out = generator(flux_kontext_dir).generate(_request(_image(40, 70), steps=1))  # aspect 0.57 -> 32x64
    assert out.status.value == "completed", out.error
    assert tuple(out.artifacts["latents"].latents.shape) == (1, 4, 8, 4)


def test_given_reference_latents_equal_diffusers(flux_kontext_dir):
    z = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    out = generator(flux_kontext_dir).generate(_request(z, 16, 32, steps=2))
    assert out.status.value == "completed", out.error
    assert torch.equal(out.artifacts["latents"].latents, _diffusers(flux_kontext_dir, z, 16, 32, steps=2))


def test_edits_of_different_sizes_share_steps_and_equal_diffusers(flux_kontext_dir):
    pipeline = load_pipeline(flux_kontext_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    cases = [(_image(60, 60, 1), 32, 48), (_image(30, 70, 2), 48, 32), (_image(60, 60, 3), 32, 48)]
    reqs = [_request(img, h, w, seed=i, rid=f"k{i}", prompt=f"edit {i}") for i, (img, h, w) in enumerate(cases)]
    outs, plans = run_recorded(pipeline, reqs, max_batch=4, max_running=4)
    assert plans.batch_sizes() == [3, 3, 3]  # every edit in each of the 3 steps
    for i, (img, h, w) in enumerate(cases):
        assert outs[f"k{i}"].status.value == "completed", outs[f"k{i}"].error
        got = outs[f"k{i}"].artifacts["latents"].latents
        err = (got - _diffusers(flux_kontext_dir, img, h, w, seed=i, prompt=f"edit {i}")).abs().max().item()
        assert err <= TOL, err  # measured: <= 6.0e-7


@pytest.mark.parametrize("request_, message", [
    (OmniRequest(task=TaskType.I2I, inputs=[TextPart(text=PROMPT)], diffusion=DiffusionParams(height=32, width=32)),
     r"FLUX.1 Kontext edits an image: add ImagePart"),
    (_request(_image(32, 32), 32, 32, strength=0.5), r"diffusion.strength does not apply to FLUX.1 Kontext"),
    (_request(torch.zeros(1, 3, 4, 4), 32, 32), r"inputs latents must be \[1, 4, h, w\]"),
    (OmniRequest(task=TaskType.T2I, inputs=[TextPart(text=PROMPT)]), r"task 't2i' is not served by 'flux.1-kontext'"),
], ids=["no-image", "strength", "latents-shape", "t2i"])
def test_bad_edits_are_refused_naming_the_field(flux_kontext_dir, request_, message):
    gen = generator(flux_kontext_dir)
    with pytest.raises(RequestRejected, match=message):
        gen.generate(request_)
    assert not gen.engine.has_unfinished()


def _steps_of(pipeline, reqs, **policy):
    outs, plans = run_recorded(pipeline, reqs, **policy)
    assert all(out.status.value == "completed" for out in outs.values())
    return plans.batch_sizes()


def test_the_reference_tokens_count_in_the_step_cost_and_the_token_budget(flux_kontext_dir):
    """Every Kontext forward carries the reference's tokens beside the noisy ones: the
    admission estimate (FLOPs, activations) and the scheduler's token budget count them."""
    pipeline = load_pipeline(flux_kontext_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    node, ctx = pipeline.spec.node("denoise"), pipeline.contexts["denoise"]
    denoiser = node.stage.denoiser
    # a 60x60 image -> 48x48 (its Kontext size) -> [1, 4, 6, 6] latents: 9 tokens; the 32x48 output: 6
    reqs = [_request(_image(60, 60, i), 32, 48, rid=f"k{i}", seed=i, steps=1) for i in range(2)]
    state = pipeline.admit(reqs[0])
    assert denoiser.condition_shapes(ctx, state.request) == {"reference": (1, 4, 6, 6)}
    z = torch.randn(1, 4, 4, 6)  # given reference latents: their own shape
    assert denoiser.condition_shapes(ctx, pipeline.admit(_request(z, 16, 32)).request) == {"reference": (1, 4, 4, 6)}
    noisy, both = {"image": (1, 4, 4, 6)}, {"image": (1, 4, 4, 6), "reference": (1, 4, 6, 6)}
    text = denoiser.tokens_per_forward(ctx, noisy) - 6
    assert denoiser.tokens_per_forward(ctx, both) == text + 6 + 9
    estimate = node.stage.estimate(ctx, state)
    assert estimate.flops_per_step == denoiser.flops_per_forward(ctx, both) > denoiser.flops_per_forward(ctx, noisy)
    assert estimate.peak_bytes == denoiser.activation_bytes(ctx, both) > denoiser.activation_bytes(ctx, noisy)
    # two edits of text + 15 tokens each: a budget one token short of both runs them one at a time
    # (counting only the noisy tokens, they would share the step); a budget of both shares it
    assert _steps_of(pipeline, reqs, max_batch=4, max_batch_tokens=2 * (text + 15) - 1) == [1, 1]
    assert _steps_of(pipeline, reqs, max_batch=4, max_batch_tokens=2 * (text + 15)) == [2]
