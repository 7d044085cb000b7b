"""Whole-pipeline parity: our engine on diffusers' AnyFlowFARPipeline folder (tiny random
weights saved with diffusers) against AnyFlowFARPipeline itself, same seed and steps.

T2V (with and without CFG), I2V (one conditioning frame) and V2V (five frames: two context
chunks, the second half filled), on 3 chunks with full_chunk_limit 2 (the last chunk reads
a compressed one). Measured (fp32, CPU): latents within 2.2e-6 of diffusers' (T2V with CFG;
5e-7 without) and decoded frames within 1.6e-6 (asserted <= 1e-4 like the Wan pipeline
tests); the streamed uint8 video is the rounding of diffusers' frames (at most 1 level off).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.api.generator import VideoGenerator
from omniloop.pipeline.stages.decode import latents_to_unit_range
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
TOL = 1e-4
SIZE = dict(height=32, width=64, num_frames=17)  # latents 4 x 8: full grid 2 x 4, compressed 1 x 2


@pytest.fixture(scope="module")
def generator(far_dir):
    return VideoGenerator.from_pretrained(far_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(far_dir):
    import diffusers

    return diffusers.AnyFlowFARPipeline.from_pretrained(far_dir, torch_dtype=torch.float32)


def _frames_uint8(seed: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, SIZE["height"], SIZE["width"], 3), dtype=np.uint8)


@torch.no_grad()
def _diffusers_decode(reference, latents: torch.Tensor) -> np.ndarray:
    """What AnyFlowFARPipeline does after its loop for output_type="np" (one call, not two)."""
    vae = reference.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    return reference.video_processor.postprocess_video(video, output_type="np")


def _compare(generator, reference, task, inputs, ref_video, *, steps=2, guidance=1.0, seed=7):
    params = dict(SIZE, steps=steps, guidance_scale=guidance, seed=seed, negative_prompt=NEGATIVE)
    request = OmniRequest(task=task, inputs=[TextPart(text=PROMPT), *inputs], diffusion=DiffusionParams(**params),
                          outputs=OutputSpec(return_latents=True))
    out = generator.generate(request)
    assert out.status.value == "completed", out.error
    latents = out.artifacts["latents"].latents

    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=guidance,
                video=ref_video, **SIZE)
    ref_lat = reference(generator=torch.Generator().manual_seed(seed), output_type="latent", **call).frames
    ref = _diffusers_decode(reference, ref_lat)  # [1, F, H, W, 3]

    assert latents.shape == ref_lat.shape
    lat_err = (latents - ref_lat).abs().max().item()
    frames = latents_to_unit_range(generator.pipeline.components["vae"], latents).permute(0, 2, 3, 4, 1).numpy()
    frame_err = np.abs(frames - ref).max()
    assert lat_err <= TOL and frame_err <= TOL, (lat_err, frame_err)
    video = out.video.frames.numpy().astype(np.int16)  # streamed chunk by chunk
    assert video.shape == ref[0].shape
    assert np.abs(video - np.round(ref[0] * 255)).max() <= 1
    return lat_err, frame_err


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_t2v_matches_diffusers(generator, reference, guidance):
    _compare(generator, reference, TaskType.T2V, [], None, guidance=guidance)


def test_i2v_matches_diffusers(generator, reference):
    image = _frames_uint8(1, 1)
    ref_video = torch.from_numpy(image.astype(np.float32) / 255.0).permute(0, 3, 1, 2)[None]  # [1, 1, 3, H, W]
    _compare(generator, reference, TaskType.I2V, [ImagePart(data=Image.fromarray(image[0]))], ref_video)


def test_v2v_matches_diffusers(generator, reference):
    clip = _frames_uint8(2, 5)  # 2 latent frames: chunk 0 and half of chunk 1 are given
    ref_video = torch.from_numpy(clip.astype(np.float32) / 255.0).permute(0, 3, 1, 2)[None]  # [1, 5, 3, H, W]
    _compare(generator, reference, TaskType.V2V, [VideoPart(data=clip)], ref_video)


def test_first_chunk_knobs_are_the_rollouts_and_go_flat(generator):
    """``first_chunk_*`` are the chunk rollout's knobs (its ``ChunkRolloutParams``): passed flat
    to the offline API they reach its node's params; on a rollout conditioned on a given frame
    its own admission check refuses them, naming the knob."""
    request = generator.build_request(PROMPT, first_chunk_steps=3, first_chunk_guidance_scale=2.0, steps=2, **SIZE)
    assert request.node_params == {"rollout": {"first_chunk_steps": 3, "first_chunk_guidance_scale": 2.0}}
    assert {"first_chunk_guidance_scale", "first_chunk_steps"} <= set(generator.pipeline.knobs.names)
    image = np.zeros((SIZE["height"], SIZE["width"], 3), np.uint8)
    with pytest.raises(ValueError, match=r"node_params\['rollout'\]\.first_chunk_steps=3: no loop of this 'i2v' request "
                                         r"makes a chunk from the prompt alone .* use steps, or drop first_chunk_steps"):
        generator.generate_video(PROMPT, image=image, first_chunk_steps=3, steps=1, save_video=False, **SIZE)
