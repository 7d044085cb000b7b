"""Wan2.1 I2V (CLIP vision tokens beside the latent concat) and first-last-frame (FLF2V)
against diffusers' ``WanImageToVideoPipeline`` on tiny random folders built and saved with
diffusers / transformers: the image encoded as ``encode_image`` does (penultimate hidden
state), the last frame's latent in the condition and the mask, the DiT's image k/v.

Tolerance: the one of tests/models/wan/test_pipeline_parity.py (5e-6 absolute on fp32
latents; CPU kernels take other vectorized paths on differently aligned weights). The CLIP
tokens themselves are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
TOL = 5e-6
CALL = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=5.0, seed=11)


def _image(seed: int, size=(40, 48)) -> Image.Image:  # not the video size: both resize it (differently)
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def _request(first, last=None, **params) -> OmniRequest:
    inputs = [TextPart(text=PROMPT), ImagePart(data=first)]
    if last is not None:
        inputs.append(ImagePart(data=last, role="last_frame"))
    return OmniRequest(task=TaskType.I2V, inputs=inputs, diffusion=DiffusionParams(negative_prompt=NEGATIVE,
                       **{**CALL, **params}), outputs=OutputSpec(return_latents=True, modalities=["latent"]))


def _diffusers(folder, first, last=None):
    import diffusers

    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    call = dict(image=first, last_image=last, prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=32,
                num_frames=5, num_inference_steps=2, guidance_scale=5.0)
    return pipe, pipe(generator=torch.Generator("cpu").manual_seed(11), output_type="latent", **call).frames


def _ours(gen, request):
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def test_wan21_i2v_clip_matches_diffusers(wan_i2v_clip_dir):
    gen = VideoGenerator.from_pretrained(wan_i2v_clip_dir, device="cpu", dtype="float32")
    assert gen.pipeline.spec.name == "wan2.1-i2v"
    first = _image(0)
    pipe, ref = _diffusers(wan_i2v_clip_dir, first)
    # the image tokens: the processor's resize/crop and the penultimate hidden state, bit for bit
    tokens = gen.pipeline.components["image_encoder"].encode([first])
    assert torch.equal(tokens, pipe.encode_image(first, torch.device("cpu")))
    latents = _ours(gen, _request(first))
    assert latents.shape == ref.shape
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err
    # the CLIP tokens condition the DiT: another first image's tokens alone change the result
    other = _ours(gen, _request(_image(5)))
    assert (other - latents).abs().max().item() > 1e-3


def test_wan21_i2v_refuses_a_last_frame(wan_i2v_clip_dir):
    gen = VideoGenerator.from_pretrained(wan_i2v_clip_dir, device="cpu", dtype="float32")
    with pytest.raises(RequestRejected, match=r"takes no last frame") as e:
        gen.generate(_request(_image(0), _image(1)))
    assert e.value.fields == ("inputs.last_frame",)
    # the offline API's last_image is the same part (and the same refusal)
    request = gen.build_request(PROMPT, image=_image(0), last_image=_image(1), **CALL)
    assert [p.role for p in request.images()] == ["first_frame", "last_frame"]
    with pytest.raises(RequestRejected, match=r"takes no last frame"):
        gen.generate(request)


def test_wan21_flf2v_matches_diffusers(wan_flf2v_dir):
    gen = VideoGenerator.from_pretrained(wan_flf2v_dir, device="cpu", dtype="float32")
    first, last = _image(0), _image(1, size=(32, 32))
    _, ref = _diffusers(wan_flf2v_dir, first, last)
    latents = _ours(gen, _request(first, last))
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err
    with pytest.raises(RequestRejected, match=r"needs a last frame too"):
        gen.generate(_request(first))


def test_wan22_first_last_frame_matches_diffusers(wan_i2v_dir):
    """Wan2.2 I2V (no image encoder): the last frame rides in the latent condition and the mask."""
    gen = VideoGenerator.from_pretrained(wan_i2v_dir, device="cpu", dtype="float32")
    first, last = _image(2, size=(32, 32)), _image(3, size=(32, 32))
    _, ref = _diffusers(wan_i2v_dir, first, last)
    latents = _ours(gen, _request(first, last))
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err
    only_first = _ours(gen, _request(first))
    assert (only_first - latents).abs().max().item() > 1e-3


@pytest.mark.parametrize("cfg_mode", ["sequential", "batched"])
def test_flf2v_steps_of_two_requests_batch_and_keep_their_images(wan_flf2v_dir, cfg_mode):
    """Two FLF2V requests' steps run as one forward (their CLIP token pairs stacked as
    [first_a, last_a, first_b, last_b]: the DiT folds each pair into one sequence), each
    result equal to the request run alone."""
    from tests.engine_plans import run_recorded

    gen = VideoGenerator.from_pretrained(wan_flf2v_dir, device="cpu", dtype="float32", cfg_mode=cfg_mode)
    reqs = [_request(_image(0), _image(1)).model_copy(update={"request_id": "a"}),
            _request(_image(2), _image(3), seed=4).model_copy(update={"request_id": "b"})]
    outs, plans = run_recorded(gen.pipeline, reqs, max_batch=4)
    assert plans.engine.stats.batched_steps >= 1
    for r in reqs:
        solo = _ours(gen, r.model_copy(update={"request_id": r.request_id + "-solo"}))
        assert (outs[r.request_id].artifacts["latents"].latents - solo).abs().max().item() <= 1e-5
