"""FLUX.2 [klein] parity against diffusers 0.42.1's Flux2KleinPipeline on a tiny random
checkpoint (built and saved with diffusers/transformers, loaded by both; fp32, CPU, same seed).

Measured: bit-exact (torch.equal) once diffusers' weights sit in fresh memory as ours do:
the transformer forward, the VAE decode, the Qwen3 prompt embeddings, text-to-image latents
and pixels (distilled klein, no CFG), text-to-image with CFG (klein base), and edits with
one and with two reference images.
"""

from __future__ import annotations

import numpy as np
import torch

from omniloop.models.families.flux2.model import Flux2Inputs
from omniloop.models.families.flux2.stages import grid_ids, text_ids
from omniloop.models.families.flux2.vae import load_flux2_vae
from omniloop.models.families.flux2.weights import load_flux2_transformer
from omniloop.models.text.qwen3 import load_qwen3_layer_states
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux2.helpers import PROMPT, generator, klein_pipeline, klein_run

H, W = 32, 48  # DiT latents 2x3: 6 image tokens


def _request(task=TaskType.T2I, extra=(), **params):
    return OmniRequest(task=task, inputs=[TextPart(text=PROMPT), *extra], diffusion=DiffusionParams(**params),
                       outputs=OutputSpec(return_latents=True))


def _ours(folder, request):
    out = generator(folder).generate(request)
    assert out.status.value == "completed", out.error
    return out


def _uint8(pixels: np.ndarray) -> np.ndarray:
    return np.round(pixels[0] * 255).astype(np.uint8)  # PIL's rounding


def test_components_equal_diffusers(klein_dir):
    pipe = klein_pipeline(klein_dir)
    dit = load_flux2_transformer(klein_dir / "transformer", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x, txt, t = torch.randn(2, 6, 16, generator=g), torch.randn(2, 9, 48, generator=g), torch.tensor([0.7, 0.2])
    img_ids, txt_ids = grid_ids(2, 3, 0, torch.device("cpu")), text_ids(9, torch.device("cpu"))
    with torch.no_grad():
        want = pipe.transformer(hidden_states=x, encoder_hidden_states=txt, timestep=t, img_ids=img_ids[None],
                                txt_ids=txt_ids[None], guidance=None, return_dict=False)[0]
        got = dit(Flux2Inputs(image=x, text=txt, timestep=t, image_ids=img_ids, text_ids=txt_ids))
    assert torch.equal(got, want)
    assert torch.equal(img_ids, pipe._prepare_latent_ids(torch.zeros(1, 1, 2, 3))[0])
    assert torch.equal(txt_ids, pipe._prepare_text_ids(txt)[0])

    vae = load_flux2_vae(klein_dir / "vae")
    z = torch.randn(1, 16, 2, 3, generator=g)
    with torch.no_grad():
        bn = pipe.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        want = pipe.vae.decode(pipe._unpatchify_latents(z * std + bn.running_mean.view(1, -1, 1, 1))).sample
        assert torch.equal(vae.decode(vae.denormalize_latents(z)), want)

    text = load_qwen3_layer_states(klein_dir / "text_encoder", klein_dir / "tokenizer", device="cpu",
                                   dtype=torch.float32, layers=(9, 18, 27))
    with torch.no_grad():
        want = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, [PROMPT, "a blue square"])
    assert torch.equal(text.encode([PROMPT, "a blue square"]).embeds, want)  # [2, 512, 48]


def test_text_to_image_equals_klein_pipeline(klein_dir):
    out = _ours(klein_dir, _request(height=H, width=W, steps=3, seed=5))
    latents, pixels = klein_run(klein_pipeline(klein_dir), H, W, 5, prompt=PROMPT, num_inference_steps=3)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))
    assert out.metrics.seed == 5 and out.metrics.steps == 3


def test_text_to_image_with_cfg_equals_klein_base_pipeline(klein_base_dir):
    """klein base: CFG against the empty prompt (the defaults' guidance 4.0)."""
    out = _ours(klein_base_dir, _request(height=H, width=W, steps=2, seed=7))
    latents, pixels = klein_run(klein_pipeline(klein_base_dir), H, W, 7, prompt=PROMPT, num_inference_steps=2,
                                guidance_scale=4.0)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))


def test_edits_with_reference_images_equal_klein_pipeline(klein_dir):
    """One reference (the output takes its size), then two of different sizes (t = 10, 20)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    first = Image.fromarray(rng.integers(0, 256, (70, 99, 3), dtype=np.uint8))  # encoded at 96x64 (center crop)
    second = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    pipe = klein_pipeline(klein_dir)
    out = _ours(klein_dir, _request(TaskType.I2I, [ImagePart(data=first)], steps=2, seed=3))
    latents, pixels = klein_run(pipe, 64, 96, 3, image=[first], prompt=PROMPT, num_inference_steps=2)
    assert out.image.image.shape == (64, 96, 3)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))

    out = _ours(klein_dir, _request(TaskType.I2I, [ImagePart(data=first), ImagePart(data=second)], height=H, width=W,
                                    steps=2, seed=4))
    latents, _ = klein_run(pipe, H, W, 4, image=[first, second], prompt=PROMPT, num_inference_steps=2)
    assert torch.equal(out.artifacts["latents"].latents, latents)
