"""LTX-2 frame conditions at any frame (guides) against diffusers' ``LTX2ConditionPipeline`` on
the tiny random checkpoint (fp32, same seed): a first frame at strength 0.8, a keyframe in the
middle at strength 0.6 and a last frame, compared on video and audio latents, decoded frames
and waveform; a guided request batched with a plain one in one engine step; bad guides refused
at admission naming the field.

Diffusers' condition index is a latent index ``l``; ours the pixel frame ``(l - 1) * 8 + 1``
for ``l > 0`` (where diffusers places the keyframe), so frame 9 of 25 is latent index 2 and the
last frame (24, latent 3) is diffusers' index -1 at frame 17: the test puts it there.
Measured: bit-equal (torch.equal) end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.ltx2.test_pipeline_parity import CALL, NEGATIVE, PROMPT, _compare, _diffusers

SIZE = dict(height=64, width=96, num_frames=25)


@pytest.fixture(scope="module")
def gen(ltx2_dir):
    return VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32", cfg_mode="batched")


def _images():
    from PIL import Image

    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((48, 80, 3), (64, 64, 3),
                                                                                        (40, 96, 3))]


def _request(inputs, seed=4, **extra):
    return OmniRequest(task=TaskType.I2V, inputs=[TextPart(text=PROMPT), *inputs],
                       node_params={"denoise": {"stg_blocks": [0]}},
                       diffusion=DiffusionParams(steps=3, seed=seed, negative_prompt=NEGATIVE, **SIZE, **extra),
                       outputs=OutputSpec(return_latents=True))


def _guides(first, middle, last):
    return [ImagePart(data=first, strength=0.8), ImagePart(data=middle, role="keyframe", frame_index=9, strength=0.6),
            ImagePart(data=last, role="keyframe", frame_index=17)]


def test_first_middle_and_last_frame_match_ltx2_condition_pipeline(ltx2_dir, gen):
    import diffusers
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    first, middle, last = _images()
    request = _request(_guides(first, middle, last))
    out = gen.generate(request)
    pipe = diffusers.LTX2ConditionPipeline.from_pretrained(ltx2_dir, torch_dtype=torch.float32)
    conditions = [LTX2VideoCondition(frames=first, index=0, strength=0.8),
                  LTX2VideoCondition(frames=middle, index=2, strength=0.6),
                  LTX2VideoCondition(frames=last, index=-1, strength=1.0)]
    call = dict(CALL, conditions=conditions, width=96, num_frames=25, spatio_temporal_guidance_blocks=[0])
    _compare(gen, out, request, *_diffusers(pipe, 4, **call), exact=True)


def test_guided_requests_batch_in_one_engine_step(gen, monkeypatch):
    """Two guided requests of one shape share each step's forward; a t2v request beside them
    runs its own (its video sequence lacks the appended keyframe tokens, and the DiT's video
    self-attention has no key mask to pad by); each ends as it does alone."""
    first, middle, last = _images()
    guided = [_request(_guides(first, middle, last), seed=s) for s in (4, 5)]
    plain = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text=PROMPT)], node_params={"denoise": {"stg_blocks": [0]}},
                        diffusion=DiffusionParams(steps=3, seed=6, negative_prompt=NEGATIVE, **SIZE),
                        outputs=OutputSpec(return_latents=True, modalities=["video"]))
    alone = [gen.generate(r).artifacts["latents"].latents for r in guided + [plain]]
    stage = gen.pipeline.spec.node("denoise").stage
    sizes: list[int] = []
    step_many = stage.step_many
    monkeypatch.setattr(stage, "step_many", lambda ctx, loops: sizes.append(len(loops)) or step_many(ctx, loops))
    with torch.inference_mode():
        ids = [gen.engine.add_request(r) for r in guided + [plain]]
        for rid in ids:
            gen.engine.run_until_done(rid)
        outs = [gen.engine.pop_output(rid) for rid in ids]
    assert 2 in sizes and 3 not in sizes, sizes
    for out, want in zip(outs, alone):
        assert out.status.value == "completed", out.error
        assert out.artifacts["latents"].latents.shape == (1, 4 * 2 * 3, 8)  # 4 latent frames of 2 x 3 tokens: keyframe tokens dropped
        # this tiny DiT's CPU GEMMs round otherwise at batch 2 than at 1 (as tests/models/wan's)
        torch.testing.assert_close(out.artifacts["latents"].latents, want, rtol=0, atol=1e-5)


def test_last_frame_is_the_keyframe_at_minus_one_and_positions_span_one_frame(gen):
    from omniloop.models.families.ltx2.guides import keyframe_coords

    first, _, last = _images()
    as_role, as_index = (gen.generate(_request([ImagePart(data=first), part])).artifacts["latents"].latents
                         for part in (ImagePart(data=last, role="last_frame", strength=0.9),
                                      ImagePart(data=last, role="keyframe", frame_index=-1, strength=0.9)))
    assert torch.equal(as_role, as_index)
    coords = keyframe_coords((8, 32, 32), (1, 2, 3), 24, 24.0, torch.device("cpu"))  # [1, 3, 6, 2]
    assert coords.shape == (1, 3, 6, 2)
    assert torch.equal(coords[0, 0], torch.tensor([[1.0, 25 / 24]] * 6))  # frame 24 alone, in seconds
    assert torch.equal(coords[0, 1, :, 0], torch.tensor([0.0, 0, 0, 32, 32, 32]))  # rows in pixels


@pytest.mark.parametrize("part, field, match", [
    (lambda im: ImagePart(data=im, role="keyframe", frame_index=25), "inputs[1].frame_index", "outside the video"),
    (lambda im: ImagePart(data=im, role="keyframe", frame_index=-26), "inputs[1].frame_index", "outside the video"),
    (lambda im: ImagePart(data=im), "inputs[2]", "a second first_frame image"),
    (lambda im: ImagePart(data=im, role="reference"), "inputs[2]", "not role='reference'"),
])
def test_bad_guides_are_refused_naming_the_field(gen, part, field, match):
    from omniloop.request import InvalidRequest

    first = _images()[0]
    inputs = [part(first)] if field == "inputs[1].frame_index" else [ImagePart(data=first), part(first)]
    with pytest.raises(InvalidRequest, match=match) as err:
        gen.pipeline.validate_request(_request(inputs))
    assert err.value.fields == (field,)


def test_part_fields_are_validated_at_the_boundary():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="strength"):
        ImagePart(path="a.png", role="keyframe", frame_index=3, strength=1.5)
    with pytest.raises(ValidationError, match="frame_index: a keyframe image needs one"):
        ImagePart(path="a.png", role="keyframe")
    with pytest.raises(ValidationError, match="frame_index"):
        ImagePart(path="a.png", role="first_frame", frame_index=3)
    with pytest.raises(ValidationError, match="strength: a 'mask' image takes none"):
        ImagePart(path="a.png", role="mask", strength=0.5)
