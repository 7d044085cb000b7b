"""LTX-2 pipelines against diffusers on a tiny random checkpoint (fp32, same seed):
``LTX2Pipeline`` (text-to-video with sound), ``LTX2ImageToVideoPipeline`` and the two-stage
path ``LTX2Pipeline`` -> ``LTX2LatentUpsamplePipeline`` -> ``LTX2Pipeline`` (refine with the
distilled stage-2 sigmas), compared on video and audio latents, decoded frames and waveform.

Measured: t2v and i2v with batched guidance (cond + uncond one forward, as diffusers) are
bit-equal end to end; sequential guidance 1.7e-6 / 5.2e-6 max abs on video / audio latents
(batch-size GEMM rounding); the two-stage path 3.6e-7 / 4.8e-7 (the refine stage's noise mix
in fp32 vs diffusers' float noise scale). Tolerance: 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.models.families.ltx2.stages import denormalize_audio, geometry, unpack_audio, unpack_video
from omniloop.pipeline.defaults import resolve_request
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart

PROMPT, NEGATIVE = "a red circle moving right", "worst quality"
TOL = 1e-5


@pytest.fixture(scope="module")
def gen(ltx2_dir):
    return VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32", cfg_mode="batched")


@pytest.fixture(scope="module")
def t2v_pipe(ltx2_dir):
    import diffusers

    return diffusers.LTX2Pipeline.from_pretrained(ltx2_dir, torch_dtype=torch.float32)


def _request(task=TaskType.T2V, inputs=None, node_params=None, **params):
    return OmniRequest(task=task, inputs=inputs or [TextPart(text=PROMPT)], node_params=node_params or {},
                       diffusion=DiffusionParams(**params), outputs=OutputSpec(return_latents=True))


def _ours(gen, out, request, scale=1):
    """Our final latents in diffusers' output_type="latent" form (unpacked, denormalized)."""
    assert out.status.value == "completed", out.error
    c = gen.pipeline.components
    resolved = resolve_request(request, gen.pipeline.defaults)  # the size and frames admission ran
    g = geometry(resolved, c["vae"].config, c["audio_vae"].config, scale)
    video = gen.pipeline.components["vae"].denormalize(unpack_video(out.artifacts["latents"].latents, g))
    audio = denormalize_audio(out.artifacts["audio_latents"].latents, gen.pipeline.components["audio_vae"])
    return video, unpack_audio(audio, c["audio_vae"].config.latent_mel_bins)


def _compare(gen, out, request, ref_latents, ref_decoded, *, exact: bool, scale=1):
    video, audio = _ours(gen, out, request, scale)
    (ref_v, ref_a), (frames, wave) = ref_latents, ref_decoded
    if exact:
        assert torch.equal(video, ref_v) and torch.equal(audio, ref_a)
        assert np.array_equal(out.video.frames.numpy(), np.round(frames[0] * 255).astype(np.uint8))
        assert torch.equal(out.audio.samples, wave[0])
    else:
        errs = [(video - ref_v).abs().max().item(), (audio - ref_a).abs().max().item(),
                (out.audio.samples - wave[0]).abs().max().item()]
        assert max(errs) <= TOL, errs
        assert np.abs(out.video.frames.numpy().astype(int) - np.round(frames[0] * 255)).max() <= 1
    assert out.audio.sample_rate == 8000 and out.video.fps == (request.diffusion.fps or 24)


CALL = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=64, num_frames=9, num_inference_steps=3,
            spatio_temporal_guidance_blocks=[1], return_dict=False)


def _diffusers(pipe, seed, **call):
    lat = pipe(generator=torch.Generator().manual_seed(seed), output_type="latent", **call)
    dec = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **call)
    return lat, dec


@pytest.mark.parametrize("cfg_mode", ["batched", "sequential"])
def test_t2v_with_sound_matches_ltx2_pipeline(ltx2_dir, gen, t2v_pipe, cfg_mode):
    ours = gen if cfg_mode == "batched" else VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32",
                                                                            cfg_mode=cfg_mode)
    request = _request(steps=3, seed=3, height=64, width=64, num_frames=9, negative_prompt=NEGATIVE,
                       node_params={"denoise": {"stg_blocks": [1]}})
    out = ours.generate(request)
    assert set(out.artifacts) >= {"video", "audio"}
    _compare(ours, out, request, *_diffusers(t2v_pipe, 3, **CALL), exact=cfg_mode == "batched")


def test_i2v_matches_ltx2_image_to_video_pipeline(ltx2_dir, gen):
    import diffusers
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    request = _request(TaskType.I2V, [TextPart(text=PROMPT), ImagePart(data=image)], steps=3, seed=5, height=64,
                       width=96, num_frames=17, negative_prompt=NEGATIVE, node_params={"denoise": {"stg_blocks": [0]}})
    out = gen.generate(request)
    pipe = diffusers.LTX2ImageToVideoPipeline.from_pretrained(ltx2_dir, torch_dtype=torch.float32)
    call = dict(CALL, image=image, width=96, num_frames=17, spatio_temporal_guidance_blocks=[0])  # image_crf: 33
    _compare(gen, out, request, *_diffusers(pipe, 5, **call), exact=True)
    video, _ = _ours(gen, out, request)
    assert video.shape[2] == 3  # (17 - 1) / 8 + 1 latent frames, frame 0 the image's


def test_two_stage_base_upsample_refine_matches_diffusers(ltx2_dir, gen, t2v_pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES as S2

    request = _request(steps=2, seed=7, height=64, width=64, num_frames=9,
                       node_params={"denoise": {"stg_blocks": [1]}, "upsample": {}})
    out = gen.generate(request)
    assert list(out.metrics.node_s) == ["text_encode", "denoise", "upsample", "refine", "decode", "audio_decode"]
    assert out.metrics.steps == 2 + 3  # the refine stage runs the three distilled sigmas
    base = dict(prompt=PROMPT, height=64, width=64, num_frames=9, spatio_temporal_guidance_blocks=[1], return_dict=False)
    video, audio = t2v_pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(7), output_type="latent", **base)
    upsampler = LTX2LatentUpsamplePipeline(vae=t2v_pipe.vae, latent_upsampler=LTX2LatentUpsamplerModel.from_pretrained(
        ltx2_dir / "latent_upsampler"))
    upsampled = upsampler(latents=video, height=64, width=64, num_frames=9, output_type="latent", return_dict=False)[0]
    stage2 = t2v_pipe.__class__(**{**t2v_pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler.from_config(
        t2v_pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None)})
    call = dict(base, height=128, width=128, latents=upsampled, audio_latents=audio, num_inference_steps=3, sigmas=S2,
                noise_scale=S2[0], guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    _compare(gen, out, request, *_diffusers(stage2, 7, **call), exact=False, scale=2)
    assert out.video.frames.shape == (9, 128, 128, 3)  # twice the base resolution


def test_flat_loop_knobs_change_the_output_as_ltx2_pipeline(gen, t2v_pipe):
    """LTX-2's own knobs passed flat to ``generate_video`` under diffusers' names (its denoise
    loop's schema declares them; the knob table puts them on the base stage's node) give
    diffusers' output for the same call: STG of the video stream only, the audio stream's CFG."""
    knobs = dict(stg_scale=2.0, audio_guidance_scale=5.0, spatio_temporal_guidance_blocks=[1])
    call = dict(num_inference_steps=3, seed=3, height=64, width=64, num_frames=9, negative_prompt=NEGATIVE)
    request = gen.build_request(PROMPT, **call, **knobs)
    assert request.node_params == {"denoise": {"stg_scale": 2.0, "audio_guidance_scale": 5.0, "stg_blocks": [1]}}
    ours = gen.generate_video(PROMPT, save_video=False, **call, **knobs)
    frames, wave = t2v_pipe(generator=torch.Generator().manual_seed(3), output_type="np",
                            **dict(CALL, stg_scale=2.0, audio_guidance_scale=5.0))
    assert np.array_equal(ours.frames, np.round(frames[0] * 255).astype(np.uint8))
    assert torch.equal(torch.from_numpy(ours.audio), wave[0])
    _, default_wave = t2v_pipe(generator=torch.Generator().manual_seed(3), output_type="np", **CALL)
    assert not torch.equal(default_wave[0], wave[0])  # the knobs changed what diffusers makes, and ours alike
