"""LTX-2 video guides (a frame sequence held from a frame: a Canny / depth / pose control video)
against diffusers' ``LTX2ConditionPipeline`` with ``LTX2VideoCondition(frames=[9 frames])`` on
the tiny random checkpoint (fp32, same seed), the guide read from a real mp4 (PyAV):

- ``VideoPart(role="first_frame")`` is diffusers' index 0: the 9 frames written into latent
  frames 0-1 of the video;
- ``VideoPart(role="keyframe", frame_index=9)`` is diffusers' latent index 2 (pixel frame
  ``(2 - 1) * 8 + 1``): 2 latent frames appended after the video's tokens.

Compared on video and audio latents, decoded frames and waveform: bit-equal (torch.equal), as
the single-frame guides. Also: a batched step keeps each request's guide, a guide at frame 0
gets the video's own causal positions, bad guides are refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, InvalidRequest, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart
from tests.models.ltx2.test_pipeline_parity import CALL, NEGATIVE, PROMPT, _compare, _diffusers

SIZE = dict(height=64, width=96, num_frames=25)


@pytest.fixture(scope="module")
def gen(ltx2_dir):
    return VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32", cfg_mode="batched")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Two real mp4 files of 9 and 11 frames (48 x 80, moving bars: a control video's edges),
    and their decoded frames (what both pipelines are given)."""
    from omniloop.io.video import read_video, write_mp4

    out = []
    for n, seed in ((9, 1), (11, 2)):
        rng = np.random.default_rng(seed)
        frames = np.zeros((n, 48, 80, 3), np.uint8)
        for t in range(n):
            frames[t, :, (4 * t) % 80:(4 * t) % 80 + 8] = rng.integers(64, 256, 3, dtype=np.uint8)
        path = tmp_path_factory.mktemp("clips") / f"guide{n}.mp4"
        write_mp4(frames, path, fps=8, crf=10)
        out.append((str(path), read_video(str(path))[0]))
    return out


def _request(inputs, seed=4):
    return OmniRequest(task=TaskType.I2V, inputs=[TextPart(text=PROMPT), *inputs],
                       node_params={"denoise": {"stg_blocks": [0]}},
                       diffusion=DiffusionParams(steps=3, seed=seed, negative_prompt=NEGATIVE, **SIZE),
                       outputs=OutputSpec(return_latents=True))


@pytest.mark.parametrize("first_strength, guide_strength", [(1.0, 0.5), (0.5, 1.0)])
def test_video_guides_at_frame_0_and_9_match_ltx2_condition_pipeline(ltx2_dir, gen, clips, first_strength,
                                                                     guide_strength):
    import diffusers
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from PIL import Image

    (path9, frames9), (path11, frames11) = clips
    request = _request([VideoPart(path=path9, role="first_frame", strength=first_strength),
                        VideoPart(path=path11, role="keyframe", frame_index=9, strength=guide_strength)])
    out = gen.generate(request)
    pipe = diffusers.LTX2ConditionPipeline.from_pretrained(ltx2_dir, torch_dtype=torch.float32)
    conditions = [LTX2VideoCondition(frames=[Image.fromarray(f) for f in frames9], index=0, strength=first_strength),
                  LTX2VideoCondition(frames=[Image.fromarray(f) for f in frames11], index=2, strength=guide_strength)]
    call = dict(CALL, conditions=conditions, width=96, num_frames=25, spatio_temporal_guidance_blocks=[0])
    _compare(gen, out, request, *_diffusers(pipe, 4, **call), exact=True)


def test_batched_video_guided_requests_keep_their_own_guides(gen, clips):
    """Two requests with different guide videos (same token count) share each step's forward
    and each ends as it does alone."""
    from tests.engine_plans import run_recorded

    (path9, _), (path11, _) = clips
    requests = [_request([VideoPart(path=p, role="keyframe", frame_index=9, strength=0.7)], seed=5) for p in (path9, path11)]
    alone = [gen.generate(r).artifacts["latents"].latents for r in requests]
    assert not torch.equal(*alone)
    outs, plans = run_recorded(gen.pipeline, [r.model_copy(update={"request_id": f"g{i}"}) for i, r in enumerate(requests)],
                               max_batch=2)
    assert 2 in plans.batch_sizes("denoise"), plans.batch_sizes()
    for rid, want in zip(("g0", "g1"), alone):
        out = outs[rid]
        assert out.status.value == "completed", out.error
        assert out.artifacts["latents"].latents.shape == (1, 4 * 2 * 3, 8)  # the 2 appended latent frames dropped
        torch.testing.assert_close(out.artifacts["latents"].latents, want, rtol=0, atol=1e-5)  # batch-2 GEMM rounding


def test_a_guide_at_frame_0_takes_the_videos_own_positions(gen):
    from omniloop.models.families.ltx2.guides import keyframe_coords

    dit = gen.pipeline.components["transformer"]
    video = dit.rope.video_coords(1, 2, 2, 3, torch.device("cpu"), 24.0)  # latent frames 0-1 of a 64 x 96 video
    guide = keyframe_coords(dit.rope.scale_factors, (2, 2, 3), 0, 24.0, torch.device("cpu"), pixel_frames=9)
    assert torch.equal(guide, video)
    later = keyframe_coords(dit.rope.scale_factors, (2, 2, 3), 9, 24.0, torch.device("cpu"), pixel_frames=9)
    assert torch.equal(later[0, 0, ::6] * 24, torch.tensor([[9.0, 17.0], [17.0, 25.0]]))  # diffusers: no causal shift


def test_an_11_frame_guide_holds_its_first_9(gen, clips):
    (_, frames9), (path11, frames11) = clips
    cut = _request([VideoPart(data=frames11[:9], role="keyframe", frame_index=1, strength=0.9)])
    whole = _request([VideoPart(path=path11, role="keyframe", frame_index=1, strength=0.9)])
    assert torch.equal(*(gen.generate(r).artifacts["latents"].latents for r in (cut, whole)))


@pytest.mark.parametrize("part, field, match", [
    (dict(role="keyframe", frame_index=5), "inputs[1].frame_index", "starts at frame 0 or 8k\\+1"),
    (dict(role="keyframe", frame_index=17), "inputs[1]", "run past the video's 25 frames"),
    (dict(role="keyframe", frame_index=25), "inputs[1].frame_index", "outside the video"),
    (dict(role="source"), "inputs[1]", "not role='source'"),
])
def test_bad_video_guides_are_refused_naming_the_field(gen, clips, part, field, match):
    (path9, _), _ = clips
    with pytest.raises(InvalidRequest, match=match) as err:
        gen.pipeline.validate_request(_request([VideoPart(path=path9, **part)]))
    assert err.value.fields == (field,)


def test_unreadable_guide_and_bad_fields_are_refused():
    from pydantic import ValidationError

    from omniloop.models.families.ltx2.guides import decoded_guides

    with pytest.raises(InvalidRequest, match="inputs\\[1\\]: cannot read video") as err:
        decoded_guides(_request([VideoPart(b64="bm90IGEgdmlkZW8=", role="keyframe", frame_index=1)]))
    assert err.value.fields == ("inputs[1]",)
    with pytest.raises(InvalidRequest, match="inputs\\[1\\]: its frames differ in size: frame 0 is 8x8, frame 1 8x6"):
        decoded_guides(_request([VideoPart(data=[np.zeros((8, 8, 3), np.uint8), np.zeros((6, 8, 3), np.uint8)],
                                           role="first_frame")]))
    with pytest.raises(InvalidRequest, match="inputs\\[1\\]: frames must be uint8"):
        decoded_guides(_request([VideoPart(data=np.zeros((9, 8, 8, 3), np.float32), role="first_frame")]))
    with pytest.raises(ValidationError, match="frame_index: a keyframe video needs one"):
        VideoPart(path="a.mp4", role="keyframe")
    with pytest.raises(ValidationError, match="strength: a 'mask' video takes none"):
        VideoPart(path="a.mp4", role="mask", strength=0.5)
    assert ImagePart(path="a.png", role="keyframe", frame_index=3).frame_index == 3
