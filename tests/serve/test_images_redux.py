"""``/v1/images/variations`` on a FLUX.1 model with Redux: a live server on 127.0.0.1 over the
tiny Flux + Redux folder, driven by the official openai client (``images.create_variation``).
Each variation is a prompt-less text-to-image request with the upload as its Redux reference;
what the server returns equals the offline API's output for that request (PNG bytes decoded:
uint8 equal), which tests/models/flux/test_redux.py ties to diffusers' FluxPriorReduxPipeline
+ FluxPipeline. A model without Redux is refused naming what to load."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, TaskType
from tests.serve.conftest import live_server


@pytest.fixture(scope="module")
def server(flux_redux_dir):
    with live_server(flux_redux_dir, limits={"max_steps": 4, "max_images": 2}) as s:
        yield s


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


SOURCE = np.random.default_rng(0).integers(0, 256, (30, 44, 3), dtype=np.uint8)


def test_variations_equal_the_offline_api(server, flux_redux_dir):
    res = server.client().images.create_variation(image=("src.png", _png(SOURCE), "image/png"), n=2, size="32x32",
                                                  response_format="b64_json", extra_body={"steps": 2, "seed": 1})
    got = [_pixels(d.b64_json) for d in res.data]
    assert [g.shape for g in got] == [(32, 32, 3)] * 2 and not np.array_equal(got[0], got[1])  # seeds 1, 2
    offline = VideoGenerator.from_pretrained(flux_redux_dir, device="cpu", dtype="float32")
    for seed, pixels in zip((1, 2), got):
        request = OmniRequest(task=TaskType.T2I, inputs=[ImagePart(data=SOURCE, role="reference")],
                              diffusion=DiffusionParams(height=32, width=32, steps=2, seed=seed))
        out = offline.generate(request)
        assert out.image is not None, out.error
        assert np.array_equal(pixels, out.image.image.numpy())


def test_redux_scale_knobs_ride_as_extra_fields(server):
    res = server.client().images.create_variation(image=("src.png", _png(SOURCE), "image/png"), size="32x32",
                                                  extra_body={"steps": 1, "seed": 1, "prompt_embeds_scale": 0.5})
    plain = server.client().images.create_variation(image=("src.png", _png(SOURCE), "image/png"), size="32x32",
                                                    extra_body={"steps": 1, "seed": 1})
    assert not np.array_equal(_pixels(res.data[0].b64_json), _pixels(plain.data[0].b64_json))
    # JSON: the image as a data: URL makes the multipart upload's image
    as_json = httpx.post(f"{server.url}/v1/images/variations", timeout=60, json={
        "image": "data:image/png;base64," + base64.b64encode(_png(SOURCE)).decode(), "size": "32x32", "steps": 1,
        "seed": 1})
    assert as_json.status_code == 200, as_json.text
    assert np.array_equal(_pixels(as_json.json()["data"][0]["b64_json"]), _pixels(plain.data[0].b64_json))


@pytest.mark.parametrize("files, data, param, message", [
    ({}, {"n": "1"}, "image", "a variation needs the image to vary"),
    ({"image": ("x.png", b"not an image", "image/png")}, {}, "image", "image"),
    ({"image": ("x.png", _png(SOURCE), "image/png")}, {"n": "0"}, "n", "greater than or equal to 1"),
    ({"image": ("x.png", _png(SOURCE), "image/png")}, {"size": "big"}, "size", "pattern"),
    ({"image": ("x.png", _png(SOURCE), "image/png")}, {"response_format": "gif"}, "response_format", "b64_json"),
    ({"image": ("x.png", _png(SOURCE), "image/png")}, {"prompt": "a cat"}, "prompt", "prompt"),
])
def test_bad_variations_are_400_naming_the_field(server, files, data, param, message):
    r = httpx.post(f"{server.url}/v1/images/variations", files=files, data=data, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_model_without_redux_is_refused_naming_what_to_load(flux_dir):
    with live_server(flux_dir, serve={"warmup": []}, limits={"max_steps": 2}) as plain:  # refused before any step
        with pytest.raises(openai.BadRequestError) as e:
            plain.client().images.create_variation(image=("src.png", _png(SOURCE), "image/png"))
    error = e.value.body
    assert error["param"] == "model" and "image_embedder/" in error["message"], error
