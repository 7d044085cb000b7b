"""Wan-Animate (modes ``animate`` and ``replace``) through our Engine == diffusers' ``WanAnimatePipeline`` on
the same tiny random folder, built and saved by diffusers here (fp32, CPU, 2 steps): a
reference image of another aspect (fitted on black), a pose video and a face video, the
whole video as one segment (diffusers called with ``segment_frame_length`` = its frames)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart

diffusers = pytest.importorskip("diffusers")

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
H, W, F = 32, 48, 5
TOL = 5e-6  # the other Wan pipeline parity tests' bound (our VAE encode rounds ~1e-6 otherwise)


@pytest.fixture(scope="module")
def animate_dir(wan_animate_dir):
    return wan_animate_dir


@pytest.fixture(scope="module")
def gen(animate_dir):
    return VideoGenerator.from_pretrained(animate_dir, device="cpu", dtype="float32")


def _frames(seed: int, n: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def _reference():
    from PIL import Image

    return Image.fromarray(_frames(3, 1, 40, 24)[0])  # taller than the video: fitted, black bars left and right


def _inputs(pose=None, face=None, ref=True):
    parts = [TextPart(text=PROMPT)]
    if ref:
        parts.append(ImagePart(data=_reference(), role="reference"))
    parts.append(VideoPart(data=_frames(1, F, H, W) if pose is None else pose, role="pose"))
    parts.append(VideoPart(data=_frames(2, F, 20, 20) if face is None else face, role="face"))  # resized to 16
    return parts


def _request(inputs, seed=42, guidance=1.0, **params):
    size = {"height": H, "width": W, **params}
    return OmniRequest(task=TaskType.V2V, inputs=inputs,
                       diffusion=DiffusionParams(negative_prompt=NEGATIVE, steps=2, guidance_scale=guidance, seed=seed,
                                                 **size),
                       outputs=OutputSpec(modalities=["latent"]))


def _mask_frames() -> np.ndarray:
    """White (replace) over a moving block, grey elsewhere in a corner: as RGB frames."""
    mask = np.zeros((F, H, W, 3), dtype=np.uint8)
    for i in range(F):
        mask[i, 4:20, 8 + 4 * i: 28 + 4 * i] = 255
    mask[:, -6:, :10] = 128
    return mask


def _reference_run(animate_dir, seed=42, guidance=1.0, **replace):
    """diffusers' final latents, standardised as ours (its output_type='latent' returns them
    de-standardised for the VAE: ``latents * std + mean``)."""
    from PIL import Image

    pipe = diffusers.WanAnimatePipeline.from_pretrained(animate_dir, torch_dtype=torch.float32)
    cfg = pipe.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (cfg.latents_mean, cfg.latents_std))
    latents = pipe(image=_reference(), pose_video=[Image.fromarray(f) for f in _frames(1, F, H, W)],
                face_video=[Image.fromarray(f) for f in _frames(2, F, 20, 20)], prompt=PROMPT,
                negative_prompt=NEGATIVE, height=H, width=W, segment_frame_length=F, num_inference_steps=2,
                guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent", **replace).frames
    return (latents - mean) * (1.0 / std)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no_cfg", "cfg"])
def test_animate_matches_diffusers(animate_dir, gen, guidance):
    assert gen.pipeline.spec.name == "wan2.2-animate"
    out = gen.generate(_request(_inputs(), seed=7, guidance=guidance))
    assert out.status.value == "completed", out.error
    ours = out.artifacts["latents"].latents
    ref = _reference_run(animate_dir, seed=7, guidance=guidance)
    assert ref.shape == (1, 16, 3, 4, 6) and ours.shape == (1, 16, 2, 4, 6)  # the reference frame is dropped
    err = (ours - ref[:, :, 1:]).abs().max().item()
    assert err <= TOL, err  # measured 7.2e-7 without CFG, 2.3e-6 with


def test_decoded_frames_match_diffusers(animate_dir, gen):
    """The decoded video (the reference frame dropped before decoding, as diffusers does)."""
    from PIL import Image

    request = _request(_inputs(), seed=11).model_copy(update={"outputs": OutputSpec(modalities=["video"])})
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    pipe = diffusers.WanAnimatePipeline.from_pretrained(animate_dir, torch_dtype=torch.float32)
    ref = pipe(image=_reference(), pose_video=[Image.fromarray(f) for f in _frames(1, F, H, W)],
               face_video=[Image.fromarray(f) for f in _frames(2, F, 20, 20)], prompt=PROMPT,
               negative_prompt=NEGATIVE, height=H, width=W, segment_frame_length=F, num_inference_steps=2,
               guidance_scale=1.0, generator=torch.Generator("cpu").manual_seed(11), output_type="np").frames
    video = out.video.frames.numpy().astype(np.int16)  # [F, H, W, 3] uint8: the rounded float frames
    assert video.shape == ref[0].shape == (F, H, W, 3)
    assert np.abs(video - np.round(ref[0] * 255)).max() <= 1


def test_replace_mode_matches_diffusers(animate_dir, gen):
    from PIL import Image

    background, mask = _frames(5, F, H, W), _mask_frames()
    inputs = _inputs() + [VideoPart(data=background), VideoPart(data=mask, role="mask")]
    out = gen.generate(_request(inputs, seed=3, guidance=3.0))
    assert out.status.value == "completed", out.error
    ours = out.artifacts["latents"].latents
    ref = _reference_run(animate_dir, seed=3, guidance=3.0, mode="replace",
                         background_video=[Image.fromarray(f) for f in background],
                         mask_video=[Image.fromarray(f) for f in mask])
    err = (ours - ref[:, :, 1:]).abs().max().item()
    assert err <= TOL, err  # measured 2.0e-6 (CFG 3)
    animate = gen.generate(_request(_inputs(), seed=3, guidance=3.0)).artifacts["latents"].latents
    assert (animate - ours).abs().max() > 1e-2  # the background and mask condition the result


def test_bad_animate_inputs_are_refused_naming_the_input(gen):
    with pytest.raises(RequestRejected, match="needs ImagePart\\(role='reference'") as err:
        gen.generate(_request(_inputs(ref=False)))
    assert err.value.fields == ("inputs.reference",)
    with pytest.raises(RequestRejected, match="needs VideoPart\\(role='pose'") as err:
        gen.generate(_request([p for p in _inputs() if getattr(p, "role", None) != "pose"]))
    assert err.value.fields == ("inputs.pose",)
    with pytest.raises(RequestRejected, match="face video has 3 frames and the pose video 5") as err:
        gen.generate(_request(_inputs(face=_frames(2, 3, 20, 20))))
    assert err.value.fields == ("inputs.face",)
    with pytest.raises(RequestRejected, match="pose video has 4 frames; Wan encodes 4k\\+1 frames: pass 1 or 5"):
        gen.generate(_request(_inputs(pose=_frames(1, 4, H, W), face=_frames(2, 4, 20, 20))))
    with pytest.raises(RequestRejected, match="num_frames=9 but the pose video has 5 frames"):
        gen.generate(_request(_inputs(), num_frames=9))
    with pytest.raises(RequestRejected, match=r"not served by 'wan2.2-animate'; pass one of \['v2v'\]"):
        gen.generate(_request(_inputs()).model_copy(update={"task": TaskType.I2V}))
    with pytest.raises(RequestRejected, match="came alone: add VideoPart\\(role='mask'\\)") as err:
        gen.generate(_request(_inputs() + [VideoPart(data=_frames(5, F, H, W))]))
    assert err.value.fields == ("inputs.mask",)
    with pytest.raises(RequestRejected, match="the mask video has 3 frames and the pose video 5") as err:
        gen.generate(_request(_inputs() + [VideoPart(data=_frames(5, F, H, W)),
                                           VideoPart(data=_mask_frames()[:3], role="mask")]))
    assert err.value.fields == ("inputs.mask",)
    with pytest.raises(RequestRejected, match="multiple of|divisible"):
        gen.generate(_request(_inputs(), height=H + 4))


def test_pose_and_face_videos_are_refused_by_other_wan_models(wan_t2v_dir):
    t2v = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text=PROMPT), VideoPart(data=_frames(1, F, H, W),
                                                                                     role="pose")],
                          diffusion=DiffusionParams(height=H, width=W, num_frames=F, steps=1))
    with pytest.raises(RequestRejected, match="takes no pose video .*WanAnimatePipeline") as err:
        t2v.generate(request)
    assert err.value.fields == ("inputs.pose",)
