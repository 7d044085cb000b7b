"""Dynamo wire objects -> OmniRequest through serve/wire.py: field mapping and the 400
messages (no Dynamo needed). Deployment limits are the engine's (tests/serve/test_limits.py)."""

from __future__ import annotations

import base64
import io

import pytest

from omniloop.deploy import Limits
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.loops.denoise import DenoiseParams
from omniloop.request import KnobTable, LoopKnob, TaskType
from omniloop.serve.wire import ServedModel
from omniloop.serve.wire import dynamo_images as image_call
from omniloop.serve.wire import dynamo_video as video_call

pytestmark = pytest.mark.fleet

DEFAULTS = GenerationDefaults(steps=50, height=480, width=832, num_frames=81, fps=16, frames_per_latent=4)
# a Wan pipeline's loop knobs (pipeline.knobs of its one denoise node)
KNOBS = KnobTable("wan", {"guidance_scale_2": (LoopKnob("denoise", "guidance_scale_2"),)}, {"denoise": DenoiseParams})


def model(tasks=(TaskType.T2V, TaskType.T2I), **limits) -> ServedModel:
    return ServedModel(name="wan", tasks=frozenset(tasks), defaults=DEFAULTS, limits=Limits(**limits), knobs=KNOBS)


def png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_video_fields_and_nvext_map_onto_diffusion_params():
    body = {"model": "wan", "prompt": "a cat", "size": "832x480", "seconds": 2, "response_format": "b64_json",
            "nvext": {"num_inference_steps": 30, "guidance_scale": 4.5, "guidance_scale_2": 3.0, "seed": 7,
                      "negative_prompt": "blurry", "fps": 24, "annotations": ["x"]},
            "extra_args": {"media_passthrough": {"shift": 5.0, "sampler": "flow_euler", "priority": 3}}}
    call = video_call(body, "req-1", model())
    r, p = call.request, call.request.diffusion
    assert (r.request_id, r.task, r.prompt, r.priority, call.stream) == ("req-1", TaskType.T2V, "a cat", 3, False)
    assert (p.width, p.height, p.steps, p.guidance_scale, p.seed) == (832, 480, 30, 4.5, 7)
    assert r.node_params == {"denoise": {"guidance_scale_2": 3.0}}  # the denoise loop's knob (its schema's)
    assert (p.negative_prompt, p.fps, p.shift, p.sampler) == ("blurry", 24, 5.0, "flow_euler")
    assert p.num_frames == 49  # 2 s at 24 fps, the nearest 4k+1 frame count


def test_seconds_yield_to_explicit_num_frames_and_defaults_stay_unset():
    call = video_call({"model": "wan", "prompt": "x", "seconds": 5, "nvext": {"num_frames": 17}}, "r", model())
    assert call.request.diffusion.num_frames == 17
    bare = video_call({"model": "wan", "prompt": "x"}, "r", model()).request.diffusion
    assert bare.steps is None and bare.height is None and bare.num_frames is None  # the model's defaults apply


def test_extra_body_takes_diffusers_names_too():
    passthrough = {"num_inference_steps": 6, "guidance": 2.5}
    call = video_call({"model": "wan", "prompt": "x", "extra_args": {"media_passthrough": passthrough}}, "r", model())
    assert (call.request.diffusion.steps, call.request.diffusion.guidance_scale) == (6, 2.5)


def test_stream_asks_for_progress_previews():
    call = video_call({"model": "wan", "prompt": "x", "stream": True}, "r", model())
    assert call.stream and call.request.outputs.stream and call.request.outputs.preview_every == 1


def test_input_reference_selects_image_to_video():
    call = video_call({"model": "wan", "prompt": "x", "input_reference": png_b64()}, "r", model((TaskType.I2V,)))
    assert call.request.task is TaskType.I2V and call.request.images()[0].b64


def test_last_image_makes_a_first_last_frame_request_from_either_place():
    """``last_image`` is sent as input_reference is: top level (a request-plane client), or nested
    in extra_args.media_passthrough by Dynamo's frontend (its NvCreateVideoRequest has no such field)."""
    i2v = model((TaskType.I2V,))
    first, last = png_b64(), "data:image/png;base64," + png_b64()
    top = video_call({"model": "wan", "prompt": "x", "input_reference": first, "last_image": last}, "r", i2v)
    nested = video_call({"model": "wan", "prompt": "x", "input_reference": first,
                         "extra_args": {"media_passthrough": {"last_image": last, "seed": 3}}}, "r", i2v)
    for call in (top, nested):
        images = call.request.images()
        assert call.request.task is TaskType.I2V
        assert [(p.role, p.b64) for p in images] == [("first_frame", first), ("last_frame", last)]
    assert nested.request.diffusion.seed == 3  # the rest of the passthrough still applies


@pytest.mark.parametrize("body, message", [
    ({"last_image": png_b64()}, "last_image: a last frame needs the first frame too: pass input_reference"),
    ({"extra_args": {"media_passthrough": {"last_image": png_b64()}}},
     "last_image: a last frame needs the first frame too: pass input_reference"),
    ({"input_reference": png_b64(), "last_image": png_b64(),
      "extra_args": {"media_passthrough": {"last_image": png_b64()}}},
     "last_image: given both at the top level and in extra_args.media_passthrough; pass it once"),
    ({"input_reference": png_b64(), "last_image": "https://example.com/a.png"}, "last_image: only data: URLs"),
    ({"input_reference": png_b64(), "last_image": "not base64!"}, "last_image: Value error, is not valid base64"),
])
def test_bad_last_images_name_last_image(body, message):
    with pytest.raises(ValueError, match="^" + _escape(message)):
        video_call({"model": "wan", "prompt": "x", **body}, "r", model((TaskType.I2V,)))


@pytest.mark.parametrize("body, message", [
    ({"prompt": ""}, "prompt: pass a non-empty text prompt (got an empty string)"),
    ({"prompt": " "}, "prompt: pass a non-empty text prompt (got only whitespace)"),
    ({"size": "big"}, "size: 'big' is not WIDTHxHEIGHT; pass e.g. '832x480'"),
    ({"seconds": 0}, "seconds: expected a positive clip length"),
    ({"nvext": {"num_inference_steps": 0}}, "nvext.num_inference_steps: Input should be greater than or equal to 1"),
    ({"nvext": {"guidance_scale": -1}}, "nvext.guidance_scale: Value error, must be >= 0"),
    ({"nvext": {"boundary_ratio": 0.5}}, "nvext.boundary_ratio: not a field this worker accepts"),
    ({"response_format": "url"}, "response_format: 'url' is not supported; this worker returns the video inline"),
    ({"output_format": "webm"}, "output_format: 'webm' is not supported"),
    ({"extra_args": {"media_passthrough": {"motion_bucket_id": 127}}}, "motion_bucket_id: not a field this worker accepts"),
    ({"nvext": {"seed": 1}, "extra_args": {"media_passthrough": {"seed": 2}}},
     "seed: 2 disagrees with nvext.seed=1; pass one of them"),
    ({"nvext": {"num_inference_steps": 4}, "extra_args": {"media_passthrough": {"steps": 5}}},
     "steps: 5 disagrees with nvext.num_inference_steps=4; pass one of them"),
    ({"input_reference": "https://example.com/a.png"}, "input_reference: only data: URLs"),
    ({"input_reference": "not base64!"}, "input_reference: Value error, is not valid base64"),
    ({"input_reference": {"file_id": "f"}}, "input_reference.file_id: this server has no files API"),
    ({"quality": "hd"}, "quality: not a field this worker accepts"),
])
def test_bad_video_fields_name_the_wire_field(body, message):
    with pytest.raises(ValueError, match="^" + _escape(message)):
        video_call({"model": "wan", "prompt": "x", **body}, "r", model())


def test_task_mismatches_say_what_to_do():
    with pytest.raises(ValueError, match="^input_reference: 'wan' has no image-to-video task"):
        video_call({"model": "wan", "prompt": "x", "input_reference": png_b64()}, "r", model())
    with pytest.raises(ValueError, match="^input_reference: 'wan' is image-to-video; pass the first frame"):
        video_call({"model": "wan", "prompt": "x"}, "r", model((TaskType.I2V,)))
    with pytest.raises(ValueError, match="does not generate images"):
        image_call({"model": "wan", "prompt": "x"}, "r", model((TaskType.T2V,)))


def test_images_become_n_requests_with_consecutive_seeds():
    call = image_call({"model": "wan", "prompt": "x", "n": 3, "size": "256x256", "nvext": {"seed": 10}}, "img", model())
    assert [r.request_id for r in call.requests] == ["img-0", "img-1", "img-2"]
    assert [r.diffusion.seed for r in call.requests] == [10, 11, 12]
    assert all(r.task is TaskType.T2I and r.diffusion.width == 256 for r in call.requests)
    with pytest.raises(ValueError, match=r"^n: 11 images in one call exceed this deployment's limit of 8 "
                                         r"\(limits\.max_images\)"):
        image_call({"model": "wan", "prompt": "x", "n": 11}, "r", model())
    with pytest.raises(ValueError, match=r"^n: expected a whole number of images >= 1, got 0.5"):
        image_call({"model": "wan", "prompt": "x", "n": 0.5}, "r", model())


def _escape(text: str) -> str:
    import re

    return re.escape(text)
