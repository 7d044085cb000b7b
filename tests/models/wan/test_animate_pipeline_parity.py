"""Wan-Animate (modes ``animate`` and ``replace``) through our Engine == diffusers' ``WanAnimatePipeline`` on
the same tiny random folder, built and saved by diffusers here (fp32, CPU, 2 steps): a
reference image of another aspect (fitted on black), a pose video and a face video; the whole
video as one segment (diffusers called with ``segment_frame_length`` = its frames), then long
videos in 2-3 segments (``prev_segment_conditioning_frames`` 1 and 5, a padded last segment),
each segment's latents and the joined video compared; the segment knobs' admission refusals."""

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


# -- long videos in segments -------------------------------------------------------------------
# (mode, prev_segment_conditioning_frames, pose frames, segment_frame_length, CFG scale): the pose
# frames chosen so that the last segment is padded (11 -> 13, 19 -> 21, 5 -> 9) or not (29)

SEGMENT_CASES = [
    ("animate", 1, 11, 5, 1.0),  # 3 segments, 2 padding frames
    ("animate", 5, 29, 13, 3.0),  # 3 segments, 5 frames carried over
    ("replace", 1, 11, 5, 3.0),  # 3 segments
    ("replace", 5, 19, 13, 1.0),  # 2 segments, 2 padding frames
    ("animate", 1, 5, 9, 1.0),  # one segment longer than the video: padded to 9 frames, cut back to 5
]


def _segment_videos(n: int) -> dict[str, np.ndarray]:
    mask = np.zeros((n, H, W, 3), dtype=np.uint8)
    for i in range(n):
        mask[i, 4:20, (2 * i) % 20: (2 * i) % 20 + 20] = 255
    return {"pose": _frames(21, n, H, W), "face": _frames(22, n, 20, 20), "background": _frames(23, n, H, W),
            "mask": mask}


def _diffusers_segments(animate_dir, videos, mode, cond, segment, guidance, seed):
    """diffusers' decoded video ``[F, H, W, 3]`` in [0, 1] and each segment's final latents
    (inside its loop: standardised as ours; the reference frame dropped), caught by a step-end
    callback."""
    from PIL import Image

    pipe = diffusers.WanAnimatePipeline.from_pretrained(animate_dir, torch_dtype=torch.float32)
    cfg = pipe.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (cfg.latents_mean, cfg.latents_std))
    caught = []

    def catch(_pipe, i, _t, kwargs):
        if i == 1:  # the segment's last step (2 steps)
            caught.append(kwargs["latents"][:, :, 1:].clone())
        return {}

    pil = {k: [Image.fromarray(f) for f in v] for k, v in videos.items()}
    replace = {"mode": "replace", "background_video": pil["background"], "mask_video": pil["mask"]} \
        if mode == "replace" else {}
    frames = pipe(image=_reference(), pose_video=pil["pose"], face_video=pil["face"], prompt=PROMPT,
                  negative_prompt=NEGATIVE, height=H, width=W, segment_frame_length=segment,
                  prev_segment_conditioning_frames=cond, num_inference_steps=2, guidance_scale=guidance,
                  generator=torch.Generator("cpu").manual_seed(seed), output_type="np", callback_on_step_end=catch,
                  callback_on_step_end_tensor_inputs=["latents"], **replace).frames[0]
    return frames, caught


@pytest.mark.parametrize("mode, cond, n, segment, guidance", SEGMENT_CASES,
                         ids=[f"{m}-c{c}-f{n}-s{s}" for m, c, n, s, _ in SEGMENT_CASES])
def test_segments_match_diffusers(animate_dir, gen, mode, cond, n, segment, guidance):
    """Each segment's final latents (the previous segment's decoded frames, re-encoded, condition
    it) and the joined video equal diffusers' rollout in segments."""
    videos = _segment_videos(n)
    parts = [TextPart(text=PROMPT), ImagePart(data=_reference(), role="reference"),
             VideoPart(data=videos["pose"], role="pose"), VideoPart(data=videos["face"], role="face")]
    if mode == "replace":
        parts += [VideoPart(data=videos["background"]), VideoPart(data=videos["mask"], role="mask")]
    request = _request(parts, seed=5, guidance=guidance).model_copy(update={
        "outputs": OutputSpec(modalities=["video", "latent"]),
        "node_params": {"denoise": {"segment_frame_length": segment, "prev_segment_conditioning_frames": cond}}})
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    ref_frames, ref_latents = _diffusers_segments(animate_dir, videos, mode, cond, segment, guidance, seed=5)
    ours = out.artifacts["latents"].latents  # [1, 16, S * f, h, w]: the segments one after the other
    f = (segment - 1) // 4 + 1
    assert ours.shape == (1, 16, len(ref_latents) * f, 4, 6)
    errs = [(ours[:, :, s * f:(s + 1) * f] - ref).abs().max().item() for s, ref in enumerate(ref_latents)]
    assert max(errs) <= TOL, errs  # measured 4.8e-7 / 1.7e-6 / 2.0e-6 / 5.2e-7 / 4.8e-7 (the cases in order)
    video = out.video.frames.numpy().astype(np.int16)  # [F, H, W, 3]
    assert video.shape == ref_frames.shape == (n, H, W, 3)
    assert np.abs(video - np.round(ref_frames * 255)).max() <= 1



def _segment_request(n: int, segment: int, cond: int = 1, seed: int = 5, **params) -> OmniRequest:
    videos = _segment_videos(n)
    parts = [TextPart(text=PROMPT), ImagePart(data=_reference(), role="reference"),
             VideoPart(data=videos["pose"], role="pose"), VideoPart(data=videos["face"], role="face")]
    knobs = {"segment_frame_length": segment, "prev_segment_conditioning_frames": cond}
    return _request(parts, seed=seed, **params).model_copy(update={"node_params": {"denoise": knobs}})


def test_segments_are_scheduler_steps_another_request_runs_between(gen):
    """A rollout of 3 segments is 3 x (2 denoise steps + a boundary) scheduler steps; a request
    added while its second segment is under way finishes before it, and the rollout's result is
    its solo run's (its state is its own: nothing on the modules)."""
    solo = gen.generate(_segment_request(11, 5)).artifacts["latents"].latents
    engine = gen.engine
    with torch.inference_mode():
        long = engine.add_request(_segment_request(11, 5))
        while engine._requests[long].loop is None or engine._requests[long].loop.segment < 1:
            engine.step()
        loop = engine._requests[long].loop
        assert loop.steps_target == 9 and loop.plan.num_segments == 3 and loop.steps_done == 3
        short = engine.add_request(_request(_inputs(), seed=9))
        while not engine._requests[short].is_finished:
            engine.step()
        assert not engine._requests[long].is_finished  # the short request ran between the long one's steps
        out = engine.run_until_done(long)
    assert out.status.value == "completed", out.error
    assert engine.pop_output(short).status.value == "completed"
    assert (out.artifacts["latents"].latents - solo).abs().max() <= TOL


def test_flat_segment_knobs_route_to_the_rollout(gen):
    knobs = gen.pipeline.knobs
    assert {"segment_frame_length", "prev_segment_conditioning_frames"} <= set(knobs.names)
    assert knobs.route({"segment_frame_length": 5}) == {"denoise": {"segment_frame_length": 5}}


@pytest.mark.parametrize("n, knobs, match, fields", [
    (11, {"segment_frame_length": 6}, r"segment_frame_length=6: Wan encodes 4k\+1 frames",
     ("node_params['denoise'].segment_frame_length",)),
    (11, {"segment_frame_length": 5, "prev_segment_conditioning_frames": 3},
     r"prev_segment_conditioning_frames=3: Wan-Animate carries 1 or 5 frames",
     ("node_params['denoise'].prev_segment_conditioning_frames",)),
    (5, {"segment_frame_length": 5, "prev_segment_conditioning_frames": 5}, r"=5 is not fewer than the segment's 5",
     ("node_params['denoise'].prev_segment_conditioning_frames", "node_params['denoise'].segment_frame_length")),
    (21, {"segment_frame_length": 9, "prev_segment_conditioning_frames": 5},
     r"segment_frame_length=9 with 5 frames carried over: .*more new frames", None),
    (1, {"segment_frame_length": 5}, r"pose video has 1 frames, no more than the 1 a segment carries over",
     ("inputs.pose",)),
    (11, {"segment_frame_length": 0}, r"segment_frame_length", ("node_params['denoise'].segment_frame_length",)),
    (9, {"segment_frame_length": 125}, r"segment_frame_length=125 is more than this model serves \(at most 121", None),
])
def test_bad_segment_knobs_are_refused_naming_the_field(gen, n, knobs, match, fields):
    request = _segment_request(n, 5).model_copy(update={"node_params": {"denoise": knobs}})
    with pytest.raises(RequestRejected, match=match) as err:
        gen.generate(request)
    if fields is not None:
        assert err.value.fields == fields
    else:
        assert err.value.fields[0] == "node_params['denoise'].segment_frame_length"


def test_a_long_pose_video_without_knobs_runs_in_segments_of_77(gen):
    """No segment_frame_length: up to 77 frames one segment of the video's own 4k+1 frames (a
    6-frame video is refused, naming the pose video and the knob); more: segments of 77."""
    from omniloop.models.families.wan.animate import SegmentPlan

    with pytest.raises(RequestRejected, match="pose video has 6 frames; Wan encodes 4k\\+1 frames: pass 5 or 9") as err:
        gen.generate(_request(_inputs(pose=_frames(1, 6, H, W), face=_frames(2, 6, 20, 20))))
    assert err.value.fields == ("inputs.pose",)
    assert "segment_frame_length" in err.value.hint
    plan = SegmentPlan(frames=200, segment_frames=77, cond_frames=1)
    assert (plan.num_segments, plan.target_frames, plan.bounds(2)) == (3, 229, (152, 229))
    assert SegmentPlan(frames=77, segment_frames=77, cond_frames=5).num_segments == 1


def test_trajectories_are_refused_naming_the_field(gen):
    request = _request(_inputs()).model_copy(update={"outputs": OutputSpec(modalities=["latent"],
                                                                            return_trajectory=True)})
    with pytest.raises(RequestRejected, match="return_trajectory: Wan-Animate's rollout in segments") as err:
        gen.generate(request)
    assert err.value.fields == ("outputs.return_trajectory",)
