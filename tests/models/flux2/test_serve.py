"""FLUX.2 [klein] served: a live server on 127.0.0.1 over the tiny klein checkpoint, driven by
the official openai client. ``/v1/images/generations`` makes an image as for Flux; the upload of
``/v1/images/edits`` becomes the reference of an edit. What the server returns equals the
offline API's output on the same weights (PNG bytes decoded: uint8 equal), which
tests/models/flux2/test_parity.py ties to diffusers' Flux2KleinPipeline."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from omniloop.request import DiffusionParams
from tests.models.flux2.helpers import generator
from tests.serve.conftest import live_server


@pytest.fixture(scope="module")
def server(klein_dir):
    with live_server(klein_dir, serve={"warmup": [DiffusionParams(steps=1, height=32, width=32)]},
                     limits={"max_steps": 4, "max_images": 2}) as s:
        yield s


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_generations_and_edits_equal_the_offline_api(server, klein_dir):
    offline = generator(klein_dir)
    made = server.client().images.generate(prompt="a red circle", size="48x32", extra_body={"steps": 2, "seed": 1})
    want = offline.generate_image("a red circle", height=32, width=48, steps=2, seed=1, save_image=False).image
    assert np.array_equal(_pixels(made.data[0].b64_json), want)

    source = np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    res = server.client().images.edit(image=("src.png", _png(source), "image/png"), prompt="make it green",
                                      extra_body={"steps": 2, "seed": 1})
    edited = _pixels(res.data[0].b64_json)
    assert edited.shape == (64, 80, 3)  # no size: the reference's
    want = offline.generate_image("make it green", image=source, steps=2, seed=1, save_image=False).image
    assert np.array_equal(edited, want)


_IMAGE = "data:image/png;base64," + base64.b64encode(_png(np.zeros((64, 64, 3), np.uint8))).decode()


@pytest.mark.parametrize("path, body, param, message", [
    ("edits", {"prompt": "x", "image": _IMAGE, "strength": 0.5, "steps": 1}, "strength", "does not apply to FLUX.2"),
    ("generations", {"prompt": "x", "size": "32x32", "guidance_scale": 4.0, "steps": 1}, "guidance_scale",
     "has no effect on a step-distilled FLUX.2 klein"),
    ("generations", {"prompt": "x", "size": "40x32", "steps": 1}, "size", "must be a multiple of 16"),
    ("edits", {"prompt": "x", "image": "data:image/png;base64," + base64.b64encode(
        _png(np.zeros((32, 32, 3), np.uint8))).decode(), "steps": 1}, "image", "is too small"),
])
def test_bad_klein_requests_are_400_naming_the_field(server, path, body, param, message):
    r = httpx.post(f"{server.url}/v1/images/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_an_edit_of_several_uploaded_images_uses_each_as_a_reference(server, klein_dir):
    """The openai client's list of images (multipart ``image[]``, in order) -> the references
    of one edit; equal to the offline API given the same two images."""
    from omniloop.request import ImagePart, OmniRequest, TaskType, TextPart

    rng = np.random.default_rng(2)
    first, second = (rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((64, 80, 3), (64, 64, 3)))
    res = server.client().images.edit(image=[("a.png", _png(first), "image/png"), ("b.png", _png(second), "image/png")],
                                      prompt="put them together", extra_body={"steps": 2, "seed": 3})
    request = OmniRequest(task=TaskType.I2I, inputs=[TextPart(text="put them together"), ImagePart(data=first),
                                                     ImagePart(data=second)],
                          diffusion=DiffusionParams(steps=2, seed=3))
    want = generator(klein_dir).generate(request).image.image.numpy()
    assert np.array_equal(_pixels(res.data[0].b64_json), want)


def test_too_many_or_a_bad_reference_is_400_naming_image(server):
    import openai

    good = ("a.png", _png(np.zeros((64, 64, 3), np.uint8)), "image/png")
    with pytest.raises(openai.BadRequestError) as e:  # klein: BFL's 4 references
        server.client().images.edit(image=[good] * 5, prompt="x", extra_body={"steps": 1})
    assert e.value.body["param"] == "image" and "at most 4 reference images" in e.value.body["message"]
    small = ("b.png", _png(np.zeros((32, 32, 3), np.uint8)), "image/png")
    with pytest.raises(openai.BadRequestError) as e:  # each reference is checked, not only the first
        server.client().images.edit(image=[good, small], prompt="x", extra_body={"steps": 1})
    assert e.value.body["param"] == "image" and "too small" in e.value.body["message"]
    r = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": "x", "image": [_IMAGE] * 5, "steps": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text
