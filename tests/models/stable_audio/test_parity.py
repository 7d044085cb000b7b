"""Stable Audio against diffusers' StableAudioPipeline on a tiny random checkpoint (fp32, same
seed): components bit for bit (DiT at the same batch, Oobleck VAE, T5 + projection + seconds
conditioning, cosine DPM-solver in tests/pipeline/test_cosine_dpmsolver.py), the whole
pipeline within 1e-5 (measured: latents 1.7e-6 to 2.3e-6 max abs from run to run, on a max of
2.5; waveform 5.4e-7). The one difference: we run the timestep MLP on every row of a batched
CFG forward where diffusers runs it once on a [1] timestep and broadcasts (a 1-row vs a 2-row
GEMM).
"""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

PROMPT = "a dog barking in the rain"
TOL = 1e-5


@pytest.fixture(scope="module")
def diffusers_pipe(stable_audio_dir):
    import diffusers

    return diffusers.StableAudioPipeline.from_pretrained(stable_audio_dir, torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def gen(stable_audio_dir):
    return VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32")


def _request(prompt=PROMPT, **params):
    return OmniRequest(task=TaskType.T2A, inputs=[TextPart(text=prompt)], diffusion=DiffusionParams(**params),
                       outputs=OutputSpec(return_latents=True))


def test_dit_and_vae_equal_diffusers_bit_for_bit(stable_audio_dir, diffusers_pipe, gen):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 32, generator=g), torch.rand(2, generator=g)
    enc, glob = torch.randn(2, 14, 16, generator=g), torch.randn(2, 1, 32, generator=g)
    rope = get_1d_rotary_pos_embed(4, 33, use_real=True, repeat_interleave_real=False)
    with torch.no_grad():
        ref = diffusers_pipe.transformer(x, t, encoder_hidden_states=enc, global_hidden_states=glob,
                                         rotary_embedding=rope, return_dict=False)[0]
    assert torch.equal(gen.pipeline.components["transformer"](x, t, enc, glob), ref)
    z, wave = torch.randn(1, 4, 32, generator=g), torch.rand(1, 2, 256, generator=g) * 2 - 1
    vae = gen.pipeline.components["vae"]
    with torch.no_grad():
        assert torch.equal(vae.decode(z), diffusers_pipe.vae.decode(z).sample)
        posterior = diffusers_pipe.vae.encode(wave).latent_dist
    mean, std = vae.encode(wave)
    assert torch.equal(mean, posterior.mean) and torch.equal(std, posterior.std)


@pytest.mark.parametrize("negative", ["low quality, noise", None])
def test_conditioning_equals_diffusers(gen, diffusers_pipe, negative):
    state = gen.pipeline.admit(_request(guidance_scale=7.0, duration_s=1.5, negative_prompt=negative))
    gen.pipeline.spec.node("encode").stage.forward(gen.pipeline.contexts["encode"], state)
    cond = state.artifacts["text"]
    with torch.no_grad():
        embeds = diffusers_pipe.encode_prompt(PROMPT, torch.device("cpu"), True, negative)
        start, end = diffusers_pipe.encode_duration(0.0, 1.5, torch.device("cpu"), negative is not None, 1)
    text_len = embeds.shape[1]
    assert torch.equal(cond.prompt, torch.cat([embeds[-1:], start[:1], end[:1]], dim=1))
    assert torch.equal(cond.global_states, torch.cat([start[:1], end[:1]], dim=2))
    if negative is None:
        assert torch.count_nonzero(cond.negative) == 0  # diffusers' uncond without a negative prompt
    else:
        assert torch.equal(cond.negative[:, :text_len], embeds[:1])


@pytest.mark.parametrize("cfg_mode,negative", [("sequential", "low quality, noise"), ("batched", None)])
def test_pipeline_matches_diffusers(stable_audio_dir, diffusers_pipe, cfg_mode, negative):
    gen = VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32", cfg_mode=cfg_mode)
    out = gen.generate(_request(steps=6, guidance_scale=7.0, seed=3, duration_s=1.5, negative_prompt=negative))
    assert out.status.value == "completed", out.error
    call = dict(negative_prompt=negative, num_inference_steps=6, guidance_scale=7.0, audio_end_in_s=1.5)
    ref_lat = diffusers_pipe(PROMPT, generator=torch.Generator().manual_seed(3), output_type="latent", **call).audios
    ref = diffusers_pipe(PROMPT, generator=torch.Generator().manual_seed(3), **call).audios[0]  # [2, 192]
    lat_err = (out.artifacts["latents"].latents - ref_lat).abs().max().item()
    assert lat_err <= TOL, lat_err
    audio = out.audio
    assert audio.sample_rate == 128 and audio.samples.shape == ref.shape == (2, 192)  # cropped to 1.5 s
    wave_err = (audio.samples - ref).abs().max().item()
    assert wave_err <= TOL, wave_err
    assert out.metrics.seed == 3


def test_default_duration_is_the_longest_clip(gen, diffusers_pipe):
    out = gen.generate(_request(steps=2, seed=1, guidance_scale=1.0))
    ref = diffusers_pipe(PROMPT, num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(1)).audios
    assert out.audio.samples.shape == ref[0].shape == (2, 256)  # 32 latent frames x hop 8
    assert (out.audio.samples - ref[0]).abs().max().item() <= TOL
