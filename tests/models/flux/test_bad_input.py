"""Flux admission: every bad input is refused before any work, naming the field and what to
pass instead (nothing runs, the engine keeps serving)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, ImagePart, LatentPart, OmniRequest, TaskType, TextPart
from tests.models.flux.helpers import generator


def _req(task=TaskType.T2I, extra=(), **params):
    return OmniRequest(task=task, inputs=[TextPart(text="a cat"), *extra], diffusion=DiffusionParams(**params))


@pytest.mark.parametrize("request_, message", [
    (_req(height=40, width=48), r"diffusion.height=40 must be a multiple of 16; pass 32 or 48"),
    (_req(height=32, width=1000), r"diffusion.width=1000 must be a multiple of 16; pass 992 or 1008"),
    (_req(height=32, width=32, num_frames=5), r"Flux makes one image; diffusion.num_frames must be 1"),
    (_req(height=32, width=32, shift=3.0), r"diffusion.shift does not apply to Flux"),
    (_req(height=32, width=32, negative_prompt="blurry"), r"diffusion.negative_prompt has no effect on Flux.1"),
    (_req(height=32, width=32, strength=0.5), r"diffusion.strength applies to image-to-image"),
    (_req(height=32, width=32, sampler="flow_unipc"), r"diffusion.sampler 'flow_unipc' is not offered by this model; "
                                                      r"pass one of \['flow_euler', 'flow_sde'\]"),
    (_req(TaskType.I2I, height=32, width=32), r"task i2i needs an image: add ImagePart"),
    (_req(TaskType.I2I, [LatentPart(data=torch.zeros(1, 4, 3, 3), of="image")], height=32, width=32),
     r"inputs latents must be \[1, 4, 4, 4\] for a 32x32 image"),
    (_req(TaskType.I2I, [ImagePart(b64="bm90IGFuIGltYWdl")], steps=4), r"cannot read image"),
    (_req(TaskType.T2V), r"task 't2v' is not served by 'flux.1'; pass one of \['i2i', 't2i'\]"),
    (_req(TaskType.T2I, [ImagePart(b64="bm90IGFuIGltYWdl")], height=32, width=32),
     r"task t2i takes no image; pass task i2i to start from it"),
], ids=["height", "width", "frames", "shift", "negative", "strength-t2i", "sampler", "i2i-no-image",
        "latents-shape", "unreadable-image", "task", "t2i-image"])
def test_bad_requests_are_refused_naming_the_field(flux_dir, request_, message):
    gen = generator(flux_dir)
    with pytest.raises(RequestRejected, match=message):
        gen.generate(request_)
    assert not gen.engine.has_unfinished()


def test_an_edit_without_a_size_takes_its_image_size(flux_dir):
    import numpy as np

    gen = generator(flux_dir)
    image = np.zeros((48, 32, 3), dtype=np.uint8)
    out = gen.generate(_req(TaskType.I2I, [ImagePart(data=image, role="reference")], steps=2, strength=1.0, seed=0))
    assert out.status.value == "completed", out.error
    assert out.image.image.shape == (48, 32, 3)


def test_an_edit_sized_by_its_image_is_held_to_the_limits(flux_dir):
    """The size an edit takes from its image is checked against limits.max_pixels too (the
    engine's limits run before the family fills it in, then again on what it filled)."""
    import numpy as np

    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(flux_dir, device="cpu", dtype="float32", limits={"max_pixels": 32 * 32})
    image = np.zeros((48, 32, 3), dtype=np.uint8)
    with pytest.raises(RequestRejected, match=r"32x48 = 1536 pixels exceed this deployment's limit of 1024"):
        gen.generate(_req(TaskType.I2I, [ImagePart(data=image, role="reference")], steps=1, strength=1.0,
                          height=None, width=None))
