"""Flux parity against diffusers on a tiny random FLUX.1-dev-layout checkpoint (built and
saved with diffusers/transformers, loaded by both; fp32, CPU, same seed).

Measured: every path below is bit-exact (torch.equal) once diffusers' weights sit in fresh
memory as ours do (tests/models/flux/helpers.py; read in place from safetensors they differ
by ~1e-6, see checkpoint_files.aligned): the transformer forward, the VAE encode/decode,
text-to-image latents and pixels, image-to-image from latents and from an encoded image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.models.autoencoders.kl2d import load_kl2d_vae
from omniloop.models.families.flux.model import FluxInputs
from omniloop.models.families.flux.weights import load_flux_transformer
from omniloop.models.layers.packed import Segments
from omniloop.request import DiffusionParams, ImagePart, LatentPart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

H, W = 32, 48  # latents 4x6, 6 packed image tokens


def _request(task=TaskType.T2I, extra=(), **params):
    return OmniRequest(task=task, inputs=[TextPart(text=PROMPT), *extra],
                       diffusion=DiffusionParams(height=H, width=W, guidance_scale=3.5, **params),
                       outputs=OutputSpec(return_latents=True))


def _ours(folder, request):
    out = generator(folder).generate(request)
    assert out.status.value == "completed", out.error
    return out


def test_transformer_forward_equals_diffusers(flux_dir):
    ref = diffusers_pipeline(flux_dir).transformer
    ours = load_flux_transformer(flux_dir / "transformer", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x, txt, pooled = torch.randn(1, 6, 16, generator=g), torch.randn(1, 20, 32, generator=g), torch.randn(1, 24, generator=g)
    t, guidance = torch.tensor([0.7]), torch.tensor([3.5])
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(3.0), indexing="ij"), -1).reshape(-1, 3)
    with torch.no_grad():
        want = ref(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled, timestep=t, img_ids=ids,
                   txt_ids=torch.zeros(20, 3), guidance=guidance, return_dict=False)[0]
        got = ours(FluxInputs(image=x[0], text=txt[0], pooled=pooled, timestep=t, image_ids=ids,
                              text_ids=torch.zeros(20, 3), image_segments=Segments((6,)), text_segments=Segments((20,)),
                              guidance=guidance))
    assert torch.equal(got, want[0])


def test_vae_encode_decode_equal_diffusers(flux_dir):
    ref = diffusers_pipeline(flux_dir).vae
    ours = load_kl2d_vae(flux_dir / "vae")
    image = torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(1)) * 2 - 1
    z = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        posterior = ref.encode(image).latent_dist
        moments = ours.encode(image)
        assert torch.equal(moments.mean, posterior.mean) and torch.equal(moments.std, posterior.std)
        assert torch.equal(ours.decode(z), ref.decode(z).sample)


def test_text_to_image_equals_flux_pipeline(flux_dir):
    out = _ours(flux_dir, _request(steps=3, seed=5))
    pipe = diffusers_pipeline(flux_dir)
    call = dict(prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5)
    assert torch.equal(out.artifacts["latents"].latents, diffusers_latents(pipe, H, W, 5, **call))
    pixels = pipe(height=H, width=W, generator=torch.Generator("cpu").manual_seed(5), output_type="np", **call).images
    assert np.array_equal(out.image.image.numpy(), np.round(pixels[0] * 255).astype(np.uint8))  # PIL's rounding
    assert out.metrics.seed == 5 and out.video is None


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_image_to_image_from_an_image_equals_img2img_pipeline(flux_dir, strength):
    from PIL import Image

    pil = Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8))
    out = _ours(flux_dir, _request(TaskType.I2I, [ImagePart(data=pil, role="reference")], steps=4, seed=5,
                                   strength=strength))
    pipe = diffusers_pipeline(flux_dir, "FluxImg2ImgPipeline")
    ref = diffusers_latents(pipe, H, W, 5, prompt=PROMPT, image=pil, strength=strength, num_inference_steps=4,
                            guidance_scale=3.5)
    assert torch.equal(out.artifacts["latents"].latents, ref)
    assert out.metrics.steps == 4 - int(4 - 4 * strength)  # strength 0.6 of 4 steps runs the last 2


def test_image_to_image_from_given_latents_equals_img2img_pipeline(flux_dir):
    z = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    out = _ours(flux_dir, _request(TaskType.I2I, [LatentPart(data=z, of="image")], steps=4, seed=5, strength=0.5))
    pipe = diffusers_pipeline(flux_dir, "FluxImg2ImgPipeline")
    ref = diffusers_latents(pipe, H, W, 5, prompt=PROMPT, image=z, strength=0.5, num_inference_steps=4,
                            guidance_scale=3.5)
    assert torch.equal(out.artifacts["latents"].latents, ref)
    assert out.metrics.steps == 2


def test_generate_image_returns_uint8_and_writes_a_png(flux_dir, tmp_path):
    from PIL import Image

    gen = generator(flux_dir)
    result = gen.generate_image(PROMPT, height=H, width=W, steps=2, seed=3, output_path=tmp_path / "cat.png")
    assert result.image.shape == (H, W, 3) and result.image.dtype == np.uint8
    assert result.path == tmp_path / "cat.png"
    assert np.array_equal(np.asarray(Image.open(result.path)), result.image)
    edit = gen.generate_image(PROMPT, image=result.image, steps=2, seed=3, strength=0.5, output_path=tmp_path)
    assert edit.output.status.value == "completed" and edit.path.suffix == ".png" and edit.image.shape == (H, W, 3)
    assert edit.metrics.node_s.get("image_condition", 0) > 0  # the edit ran the image condition node
