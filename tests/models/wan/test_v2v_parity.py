"""Loops from given latents on Wan: video-to-video equal to diffusers' WanVideoToVideoPipeline
(fp32, same seed), SDEdit from latents passed in, and the bad inputs of that path.

Tolerance (fp32): final latents within 1e-4 absolute (measured: 0, bit-equal).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, FieldError, LatentPart, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
H, W, F = 32, 48, 9


def _video(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(F, H, W, 3), dtype=np.uint8)


def _request(task=TaskType.V2V, inputs=None, node_params=None, **params):
    return OmniRequest(task=task, inputs=inputs or [TextPart(text=PROMPT), VideoPart(data=_video())],
                       node_params=node_params or {},
                       diffusion=DiffusionParams(negative_prompt=NEGATIVE, height=H, width=W, **params),
                       outputs=OutputSpec(modalities=["latent"]))


@pytest.fixture(scope="module")
def gen(wan_t2v_dir):
    return VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_wan_v2v_matches_diffusers(wan_t2v_dir, gen, strength):
    import diffusers
    from PIL import Image

    steps = 4
    out = gen.generate(_request(steps=steps, guidance_scale=5.0, seed=42, strength=strength))
    assert out.status.value == "completed", out.error
    assert out.metrics.steps == int(steps * strength)  # the schedule starts at the strength's step
    pipe = diffusers.WanVideoToVideoPipeline.from_pretrained(wan_t2v_dir, torch_dtype=torch.float32)
    ref = pipe(video=[Image.fromarray(f) for f in _video()], prompt=PROMPT, negative_prompt=NEGATIVE, height=H,
               width=W, num_inference_steps=steps, guidance_scale=5.0, strength=strength,
               generator=torch.Generator("cpu").manual_seed(42), output_type="latent").frames
    ours = out.artifacts["latents"].latents
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4, err
    if strength == 1.0:  # the encoded video has weight 0: bit-equal (measured: 2.1e-6 at 0.5, from the VAE encode)
        assert torch.equal(ours, ref)


def test_v2v_frames_come_from_the_video_and_bad_videos_are_refused(gen):
    ok = gen.generate(_request(steps=2, seed=1, guidance_scale=1.0))
    assert ok.artifacts["latents"].latents.shape[2] == (F - 1) // 4 + 1
    with pytest.raises(RequestRejected, match=r"diffusion.num_frames=5 but inputs\[video\] has 9 frames"):
        gen.generate(_request(steps=2, num_frames=5))
    with pytest.raises(RequestRejected, match=r"inputs\[video\] has 8 frames; Wan encodes 4k\+1 frames: pass 5 or 9"):
        gen.generate(_request(inputs=[TextPart(text=PROMPT), VideoPart(data=_video()[:8])], steps=2))
    with pytest.raises(RequestRejected, match="task v2v needs a source video"):
        gen.generate(_request(inputs=[TextPart(text=PROMPT)], steps=2))


def test_strength_bad_input_names_the_field(gen):
    with pytest.raises(ValueError, match=r"strength\n.*must be in \[0, 1\] \(got 1.5\)"):
        DiffusionParams(strength=1.5)
    with pytest.raises(RequestRejected, match=r"node_params\['denoise'\].strength: Value error, must be in \[0, 1\]"):
        gen.generate(_request(steps=2, node_params={"denoise": {"strength": -0.1}}))
    with pytest.raises(RequestRejected, match=r"diffusion.strength=0.2 with 4 steps runs no denoising step .* >= 0.25"):
        gen.generate(_request(steps=4, strength=0.2))
    t2v = _request(TaskType.T2V, [TextPart(text=PROMPT)], num_frames=F, steps=2, strength=0.5)
    with pytest.raises(RequestRejected, match=r"diffusion.strength=0.5: no loop of this 't2v' request starts from given"):
        gen.generate(t2v)
    # Wan makes the whole clip at once: its loops have no first-chunk knob (the chunk rollout's)
    with pytest.raises(FieldError, match=r"^first_chunk_guidance_scale: unknown generation parameter\(s\) "
                       r"\['first_chunk_guidance_scale'\]: not a knob of '.*'s loops \(its loop knobs: guidance_scale_2\)"):
        gen.generate_video(PROMPT, task="t2v", num_frames=F, steps=2, first_chunk_guidance_scale=3.0, save_video=False)


def test_sdedit_from_given_latents_equals_v2v_of_the_same_latents(gen):
    """A LatentPart is an InitLatents source like the encoded video: feeding V2V's encoded
    latents back as latents reproduces V2V; the wrong shape is refused naming the field."""
    state = gen.pipeline.admit(_request(steps=3, seed=5, strength=0.7))
    gen.pipeline.spec.node("video_encode").stage.forward(gen.pipeline.contexts["video_encode"], state)
    encoded = state.artifacts["init_latents"].latents["video"]
    v2v = gen.generate(_request(steps=3, seed=5, strength=0.7))
    inputs = [TextPart(text=PROMPT), LatentPart(data=encoded)]
    sdedit = gen.generate(_request(TaskType.T2V, inputs, steps=3, seed=5, strength=0.7, num_frames=F))
    assert sdedit.status.value == "completed", sdedit.error
    assert "given_latents" in sdedit.metrics.node_s and "video_encode" not in sdedit.metrics.node_s
    assert torch.equal(sdedit.artifacts["latents"].latents, v2v.artifacts["latents"].latents)
    wrong = [TextPart(text=PROMPT), LatentPart(data=encoded[:, :, :2])]
    with pytest.raises(RequestRejected, match=r"inputs\[latent of video\].data has shape \[1, 16, 2, 4, 6\] but this "
                                              r"request's geometry needs \[1, 16, 3, 4, 6\]"):
        gen.generate(_request(TaskType.T2V, wrong, steps=3, num_frames=F))
