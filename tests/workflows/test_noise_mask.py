"""ComfyUI's noise mask on a plain FLUX.1 model: LoadImage -> VAEEncode -> SetLatentNoiseMask
(the LoadImage's alpha) -> KSampler compiles to an inpainting request whose denoise loop keeps
the unmasked area ComfyUI's way (node_params denoise.noise_mask = 'comfy'). Run on the tiny
checkpoint, the kept area ends at the image's latents, as ComfyUI's KSamplerX0Inpaint blend
``denoised * m + latent_image * (1 - m)`` makes it at the last step (m from ComfyUI's bilinear
resize of the mask to the latent grid, written here); tests/models/flux/test_inpaint.py checks
every step of the comfy blend against ComfyUI's formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.flux.helpers import diffusers_pipeline
from tests.models.flux.test_inpaint import _image_latents
from tests.workflows.templates import template, template_models
from tests.workflows.test_run_templates import small

pytest.importorskip("comfyui_workflow_templates_json")

H, W = 32, 48


def _workflow(denoise: float) -> dict:
    from omniloop.workflows.ui_format import ui_to_api

    api = small(ui_to_api(template("flux_dev_checkpoint_example")))
    del api["56:50"]  # the empty latent: the image to inpaint instead
    api["60"] = {"class_type": "LoadImage", "inputs": {"image": "inpaint.png"}}
    api["61"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["60", 0], "vae": ["56:47", 0]}}
    api["62"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["61", 0], "mask": ["60", 1]}}
    api["56:52"]["inputs"].update(latent_image=["62", 0], denoise=denoise, steps=3, seed=5)
    return api


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    rgba = np.random.default_rng(2).integers(0, 256, (H, W, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[8:24, 12:40, 3] = 0  # alpha 0: the area to repaint (a left edge inside a latent pixel)
    Image.fromarray(rgba, mode="RGBA").save(folder / "inpaint.png")
    return folder


@pytest.mark.parametrize("denoise", [1.0, 0.67])
def test_set_latent_noise_mask_keeps_the_rest_of_the_image(flux_dir, input_dir, denoise):
    from PIL import Image

    from omniloop.api.generator import VideoGenerator
    from omniloop.request import OutputSpec
    from omniloop.workflows import compile_workflow

    compiled = compile_workflow(_workflow(denoise), template_models({"flux": flux_dir}), input_dir=input_dir)
    assert [d.message for d in compiled.deviations] == []
    (generation,) = compiled.generations
    request = generation.request
    assert request.task.value == "i2i" and request.node_params["denoise"]["noise_mask"] == "comfy"
    assert [p.role for p in request.images()] == ["first_frame", "mask"]
    request = request.model_copy(update={"outputs": OutputSpec(return_latents=True)})
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    ours = out.artifacts["latents"].latents
    # ComfyUI: LoadImage's mask is 1 - alpha; prepare_mask resizes it bilinearly to the latents
    alpha = np.asarray(Image.open(input_dir / "inpaint.png"))[..., 3]
    m = torch.nn.functional.interpolate(torch.from_numpy(1.0 - alpha / 255.0).float()[None, None],
                                        size=ours.shape[-2:], mode="bilinear")
    rgb = Image.open(input_dir / "inpaint.png").convert("RGB")
    latent = _image_latents(diffusers_pipeline(flux_dir, "FluxInpaintPipeline"), rgb,
                            torch.Generator("cpu").manual_seed(request.diffusion.seed))
    keep = (m == 0).expand_as(ours)
    assert keep.any() and (~keep).any()
    assert torch.allclose(ours[keep], latent[keep], atol=1e-6, rtol=0)  # ComfyUI's last step: latent_image there
    assert not torch.allclose(ours[~keep], latent[~keep], atol=1e-2)  # the masked area is redrawn


def test_set_latent_noise_mask_bad_input_is_a_node_error(flux_dir, input_dir):
    from omniloop.workflows import WorkflowError, compile_workflow

    api = _workflow(1.0)
    api["62"]["inputs"]["samples"] = ["56:50", 0]
    api["56:50"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 48, "height": 32, "batch_size": 1}}
    with pytest.raises(WorkflowError) as e:
        compile_workflow(api, template_models({"flux": flux_dir}), input_dir=input_dir)
    errors = e.value.node_errors
    assert "62" in errors and "samples" in str(errors["62"]), errors
