"""FLUX.1 Fill (inpaint / outpaint) parity against diffusers' ``FluxFillPipeline`` on a tiny
random Fill-layout checkpoint (384-style input layer: noise + masked-image latents + the
8x8-unshuffled mask; saved with diffusers, loaded by both; fp32, CPU, same seed).

Measured: the final latents are bit-equal (torch.equal) at strength 1.0 (the default, from
noise) and 0.75, and a request batched with another's steps gives the same latents.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.request import DiffusionParams, ImagePart, InvalidRequest, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

H, W = 32, 48  # latents 4x6, 6 packed image tokens


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
    mask = np.zeros((H, W), dtype=np.uint8)
    mask[8:24, 20:44] = 255  # white: repaint; an edge not on the 8x8 grid
    return image, Image.fromarray(mask)


def _request(image, mask, **params):
    parts = [TextPart(text=PROMPT), ImagePart(data=image, role="reference")]
    if mask is not None:
        parts.append(ImagePart(data=mask, role="mask"))
    return OmniRequest(task=TaskType.I2I, inputs=parts,
                       diffusion=DiffusionParams(height=H, width=W, **params),
                       outputs=OutputSpec(return_latents=True))


@pytest.mark.parametrize("strength", [1.0, 0.75])
def test_fill_equals_flux_fill_pipeline(flux_fill_dir, strength):
    image, mask = _images()
    gen = generator(flux_fill_dir)
    assert gen.pipeline.spec.name == "flux.1-fill"
    out = gen.generate(_request(image, mask, steps=4, seed=5, strength=strength))
    assert out.status.value == "completed", out.error
    pipe = diffusers_pipeline(flux_fill_dir, "FluxFillPipeline")
    # diffusers' defaults: guidance 30 (ours resolves the same when none is passed)
    ref = diffusers_latents(pipe, H, W, 5, prompt=PROMPT, image=image, mask_image=mask, strength=strength,
                            num_inference_steps=4)
    assert torch.equal(out.artifacts["latents"].latents, ref)


def test_fill_shares_steps_with_other_requests_and_equals_its_solo_run(flux_fill_dir):
    """Two Fill requests of different sizes in one packed step: each within 2e-6 of its solo
    run (the packed GEMMs' blocking, as tests/models/flux/test_packing.py measures)."""
    from tests.engine_plans import run_recorded

    image, mask = _images()
    pipeline = generator(flux_fill_dir).pipeline
    first = _request(image, mask, steps=2, seed=7).model_copy(update={"request_id": "a"})
    second = OmniRequest(request_id="b", task=TaskType.I2I, inputs=[
        TextPart(text="a blue square"), ImagePart(data=image.resize((64, 48)), role="reference"),
        ImagePart(data=mask.resize((64, 48)), role="mask")], diffusion=DiffusionParams(height=48, width=64, steps=2,
                                                                                      seed=3),
        outputs=OutputSpec(return_latents=True))
    outs, plans = run_recorded(pipeline, [first, second], max_batch=4, max_running=4)
    assert plans.batch_sizes() == [2, 2]  # both requests in each step
    for request in (first, second):
        alone = generator(flux_fill_dir).generate(request)
        got = outs[request.request_id]
        assert got.status.value == "completed", got.error
        assert torch.allclose(got.artifacts["latents"].latents, alone.artifacts["latents"].latents, atol=2e-6, rtol=0)


def test_fill_bad_input_names_the_field(flux_fill_dir, flux_dir, flux_kontext_dir):
    image, mask = _images()
    fill, plain, kontext = generator(flux_fill_dir), generator(flux_dir), generator(flux_kontext_dir)
    cases = [
        (fill, _request(image, None, steps=1), "mask"),  # an inpaint without a mask
        (fill, _request(image, mask.resize((W, H + 8)), steps=1), "mask"),  # a mask of another size
        # a mask on a model that does not inpaint (plain FLUX.1 inpaints by a noise mask: test_inpaint.py)
        (kontext, _request(image, mask, steps=1), "mask"),
        (plain, OmniRequest(task=TaskType.T2I, inputs=[TextPart(text=PROMPT), ImagePart(data=mask, role="mask")],
                            diffusion=DiffusionParams(height=H, width=W, steps=1)), "mask"),  # t2i + mask
    ]
    for g, request, field in cases:
        with pytest.raises(InvalidRequest) as err:
            g.pipeline.validate_request(request)
        assert field in err.value.fields, err.value
