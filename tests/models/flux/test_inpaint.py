"""Inpainting on a plain FLUX.1 model by the loop's latent noise mask (policies/noise_mask.py).

* ``diffusers`` mode against diffusers' ``FluxInpaintPipeline`` (image + mask_image + strength)
  on the tiny random FLUX.1-dev checkpoint, fp32, CPU, same seed. Measured: the final latents
  are bit-equal (torch.equal) at strength 1.0 and 0.6.
* ``comfy`` mode against ComfyUI's KSampler noise mask, written here from ComfyUI's formula
  (comfy/samplers.py ``KSamplerX0Inpaint`` around k-diffusion's ``sample_euler``, flow model
  sampling ``x = sigma * noise + (1 - sigma) * latent``) on diffusers' transformer, with the same
  noise, image latents and sigmas. Measured: max |ours - ComfyUI's| = 0 over the whole image at
  strength 1.0 and 0.5; the kept area ends at the image's latents (max error 6e-8).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.request import DiffusionParams, ImagePart, InvalidRequest, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

H, W = 32, 48  # latents 4x6


def _images():
    from PIL import Image

    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
    mask = np.zeros((H, W), dtype=np.uint8)
    mask[8:24, 12:40] = 255  # white: repaint; a left edge inside a latent pixel (ComfyUI's bilinear mask: 0.5)
    return image, Image.fromarray(mask)


def _request(image, mask, node_params=None, **params):
    parts = [TextPart(text=PROMPT), ImagePart(data=image, role="reference")]
    if mask is not None:
        parts.append(ImagePart(data=mask, role="mask"))
    return OmniRequest(task=TaskType.I2I, inputs=parts, diffusion=DiffusionParams(height=H, width=W, **params),
                       node_params=node_params or {}, outputs=OutputSpec(return_latents=True))


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_plain_flux_inpaint_equals_flux_inpaint_pipeline(flux_dir, strength):
    image, mask = _images()
    gen = generator(flux_dir)
    assert gen.pipeline.spec.name == "flux.1" and gen.pipeline.spec.accepts_mask
    out = gen.generate(_request(image, mask, steps=4, seed=3, strength=strength, guidance_scale=3.5))
    assert out.status.value == "completed", out.error
    pipe = diffusers_pipeline(flux_dir, "FluxInpaintPipeline")
    ref = diffusers_latents(pipe, H, W, 3, prompt=PROMPT, image=image, mask_image=mask, strength=strength,
                            num_inference_steps=4, guidance_scale=3.5)
    assert torch.equal(out.artifacts["latents"].latents, ref)


def _image_latents(pipe, image, gen: torch.Generator) -> torch.Tensor:
    """The image's latents as the loop draws them (diffusers' posterior sample, the first draw)."""
    from diffusers.pipelines.flux.pipeline_flux_inpaint import retrieve_latents

    pixels = pipe.image_processor.preprocess(image, height=H, width=W).to(torch.float32)
    with torch.no_grad():
        latent = retrieve_latents(pipe.vae.encode(pixels), generator=gen)
    return (latent - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor  # [1, C, h, w]


def _comfy_reference(pipe, image, mask, *, steps: int, seed: int, strength: float, guidance: float):
    """ComfyUI's KSampler with a noise mask, from its formula (not our code): per Euler step
    ``x_in = x * m + (sigma * noise + (1 - sigma) * latent) * (1 - m)``, the model's clean
    estimate ``denoised = x_in - sigma * v``, blended ``denoised * m + latent * (1 - m)``, then
    k-diffusion's Euler ``x += (x - denoised) / sigma * (sigma_next - sigma)``. The latents, noise
    and sigmas are the loop's (diffusers' draw order: the image's posterior sample, then noise)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    gen = torch.Generator("cpu").manual_seed(seed)
    h, w = H // 8, W // 8
    latent = _image_latents(pipe, image, gen)
    noise = torch.randn(latent.shape, generator=gen, dtype=torch.float32)
    # the noise mask: ComfyUI's prepare_mask, the soft mask resized bilinearly to the latent grid
    m = torch.from_numpy(np.asarray(mask.convert("L"), dtype=np.float32) / 255.0)[None, None]
    m = torch.nn.functional.interpolate(m, size=(h, w), mode="bilinear")
    sched = pipe.scheduler
    mu = calculate_shift(h * w // 4, sched.config.get("base_image_seq_len", 256), sched.config.get("max_image_seq_len", 4096),
                         sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    start = int(max(steps - min(steps * strength, steps), 0))
    sigmas = sched.sigmas[start:].to(torch.float32)
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=PROMPT, prompt_2=None)
    ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    g = torch.full([1], guidance, dtype=torch.float32)

    def velocity(x, sigma):
        tokens = pipe._pack_latents(x, 1, x.shape[1], h, w)
        with torch.no_grad():
            v = pipe.transformer(hidden_states=tokens, timestep=sigma.reshape(1), guidance=g, pooled_projections=pooled,
                                 encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=ids, return_dict=False)[0]
        return pipe._unpack_latents(v, H, W, pipe.vae_scale_factor)

    x = sigmas[0] * noise + (1 - sigmas[0]) * latent
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        x_in = x * m + (s * noise + (1 - s) * latent) * (1 - m)
        denoised = x_in - s * velocity(x_in, s)
        denoised = denoised * m + latent * (1 - m)
        x = x + (x - denoised) / s * (s_next - s)
    return x, latent, m


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_comfy_noise_mask_equals_comfyui_formula(flux_dir, strength):
    image, mask = _images()
    out = generator(flux_dir).generate(_request(image, mask, {"denoise": {"noise_mask": "comfy"}}, steps=4, seed=9,
                                                strength=strength, guidance_scale=3.5))
    assert out.status.value == "completed", out.error
    ours = out.artifacts["latents"].latents
    pipe = diffusers_pipeline(flux_dir, "FluxInpaintPipeline")
    ref, latent, m = _comfy_reference(pipe, image, mask, steps=4, seed=9, strength=strength, guidance=3.5)
    keep = (m == 0).expand_as(ours)
    assert keep.any() and (~keep).any() and ((m > 0) & (m < 1)).any()  # kept, repainted and blended latents
    assert torch.allclose(ours, ref, atol=1e-6, rtol=0), (ours - ref).abs().max()
    assert torch.allclose(ours[keep], latent[keep], atol=1e-6, rtol=0)  # the kept area: the image's latents
    # diffusers' mode keeps the same area (the two conventions differ in when they reset it)
    plain = generator(flux_dir).generate(_request(image, mask, steps=4, seed=9, strength=strength,
                                                  guidance_scale=3.5)).artifacts["latents"].latents
    assert torch.allclose(plain[keep], latent[keep], atol=1e-6, rtol=0)


def test_fill_keeps_the_rest_of_the_image_only_under_a_comfy_noise_mask(flux_fill_dir):
    """FLUX.1 Fill reads its mask itself (diffusers' FluxFillPipeline: no blend, as before);
    InpaintModelConditioning's noise_mask=true asks for ComfyUI's noise mask on top."""
    image, mask = _images()
    fill = generator(flux_fill_dir)
    pipe = diffusers_pipeline(flux_fill_dir, "FluxFillPipeline")
    latent = _image_latents(pipe, image, torch.Generator("cpu").manual_seed(4))
    m = torch.nn.functional.interpolate(torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255)[None, None],
                                        size=latent.shape[-2:], mode="bilinear")
    keep = (m == 0).expand_as(latent)
    runs = {mode: fill.generate(_request(image, mask, {"denoise": {"noise_mask": mode}} if mode else None, steps=3,
                                         seed=4)).artifacts["latents"].latents for mode in (None, "comfy")}
    assert torch.allclose(runs["comfy"][keep], latent[keep], atol=1e-6, rtol=0)
    assert not torch.allclose(runs[None][keep], latent[keep], atol=1e-2)  # Fill alone redraws it (close, not kept)


def test_noise_mask_bad_input_names_the_field(flux_dir, flux_kontext_dir):
    image, mask = _images()
    plain = generator(flux_dir)
    cases = [
        (plain, _request(image, mask.resize((W, H + 16)), steps=1), "mask"),  # a mask of another size
        (plain, _request(image, None, {"denoise": {"noise_mask": "comfy"}}, steps=2), "node_params['denoise'].noise_mask"),
    ]
    for g, request, field in cases:
        with pytest.raises(InvalidRequest) as err:
            g.pipeline.validate_request(request) if field == "mask" else g.generate(request).raise_for_failure()
        assert field in err.value.fields, err.value


def test_masked_requests_share_steps_with_others_and_equal_their_solo_runs(flux_dir):
    """A diffusers-mode, a comfy-mode and an unmasked request in one engine: every step batches
    all three (the mask is each request's own state), each within 2e-6 of its solo run (the
    batched GEMMs' blocking, as tests/models/flux/test_packing.py measures)."""
    from tests.engine_plans import run_recorded

    image, mask = _images()
    requests = [_request(image, m, p, steps=2, seed=s, strength=1.0).model_copy(update={"request_id": rid})
                for rid, m, p, s in (("diffusers", mask, None, 1), ("comfy", mask, {"denoise": {"noise_mask": "comfy"}}, 2),
                                     ("plain", None, None, 3))]
    outs, plans = run_recorded(generator(flux_dir).pipeline, requests, max_batch=4, max_running=4)
    assert plans.batch_sizes() == [3, 3]
    for request in requests:
        alone = generator(flux_dir).generate(request).artifacts["latents"].latents
        got = outs[request.request_id]
        assert got.status.value == "completed", got.error
        assert torch.allclose(got.artifacts["latents"].latents, alone, atol=2e-6, rtol=0)
