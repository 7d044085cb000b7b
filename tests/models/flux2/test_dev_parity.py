"""FLUX.2 [dev] parity against diffusers 0.42.1's Flux2Pipeline on a tiny random checkpoint
(Mistral3ForConditionalGeneration text encoder of 31 layers, the klein-size DiT with a guidance
embedding; built and saved with diffusers/transformers, loaded by both; fp32, CPU, same seed).

Measured: bit-exact (torch.equal): the Mistral prompt embeddings (system message, layers 10, 20,
30 stacked), text-to-image latents and pixels with embedded guidance, and an edit with two
reference images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.engine.errors import RequestRejected
from omniloop.models.text.mistral3 import load_mistral3_layer_states
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux2.helpers import PROMPT, dev_pipeline, generator, klein_run

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


def test_dev_folder_loads_as_the_dev_variant(flux2_dev_dir):
    gen = generator(flux2_dev_dir)
    assert gen.pipeline.spec.name == "flux.2-dev"
    assert gen.pipeline.defaults.steps == 50 and gen.pipeline.defaults.guidance_scale == 4.0


def test_mistral_prompt_embeddings_equal_flux2_pipeline(flux2_dev_dir):
    pipe = dev_pipeline(flux2_dev_dir)
    text = load_mistral3_layer_states(flux2_dev_dir / "text_encoder", flux2_dev_dir / "tokenizer", device="cpu",
                                      dtype=torch.float32, layers=(10, 20, 30))
    prompts = [PROMPT, "a blue [IMG] square"]
    with torch.no_grad():
        want = pipe._get_mistral_3_small_prompt_embeds(pipe.text_encoder, pipe.tokenizer, prompts)
    assert torch.equal(text.encode(prompts).embeds, want)  # [2, 512, 48]


def test_text_to_image_equals_flux2_pipeline(flux2_dev_dir):
    """Embedded guidance 2.5 (not the default: the scale must reach the DiT)."""
    out = _ours(flux2_dev_dir, _request(height=H, width=W, steps=3, seed=5, guidance_scale=2.5))
    latents, pixels = klein_run(dev_pipeline(flux2_dev_dir), H, W, 5, prompt=PROMPT, num_inference_steps=3,
                                guidance_scale=2.5)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))
    assert out.metrics.steps == 3


def test_edit_with_two_references_equals_flux2_pipeline(flux2_dev_dir):
    from PIL import Image

    rng = np.random.default_rng(1)
    first = Image.fromarray(rng.integers(0, 256, (70, 99, 3), dtype=np.uint8))  # encoded at 96x64 (center crop)
    second = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    out = _ours(flux2_dev_dir, _request(TaskType.I2I, [ImagePart(data=first), ImagePart(data=second)], steps=2,
                                        seed=4))
    latents, pixels = klein_run(dev_pipeline(flux2_dev_dir), 64, 96, 4, image=[first, second], prompt=PROMPT,
                                num_inference_steps=2)
    assert out.image.image.shape == (64, 96, 3)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))


def test_negative_prompt_is_refused_naming_the_field(flux2_dev_dir):
    with pytest.raises(RequestRejected, match="diffusion.negative_prompt"):
        generator(flux2_dev_dir).generate(_request(height=H, width=W, steps=1, negative_prompt="blurry"))


def test_more_references_than_dev_takes_are_refused_naming_the_cap(flux2_dev_dir):
    """dev: BFL's recommended maximum of 6 references (diffusers sets none), named in the error."""
    refs = [ImagePart(data=np.zeros((64, 64, 3), np.uint8)) for _ in range(7)]
    with pytest.raises(RequestRejected, match="at most 6 per edit"):
        generator(flux2_dev_dir).generate(_request(TaskType.I2I, refs, steps=1))
