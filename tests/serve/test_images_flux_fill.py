"""Inpainting over ``/v1/images/edits`` with ``mask`` on a FLUX.1 Fill model: a live server on
127.0.0.1 over the tiny Fill checkpoint (tests/flux_checkpoint.py), driven by the official
openai client. OpenAI's mask (a PNG whose transparent pixels mark the area to edit) becomes
the white-is-repaint mask diffusers' FluxFillPipeline reads; the server's PNG equals the
offline API's output for that white mask (which tests/models/flux/test_fill.py ties to
diffusers bit for bit)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import generator
from tests.serve.conftest import live_server

H, W = 32, 48
WARMUP = [DiffusionParams(steps=1, height=32, width=32)]


@pytest.fixture(scope="module")
def server(flux_fill_dir):
    with live_server(flux_fill_dir, serve={"warmup": WARMUP}, limits={"max_steps": 4, "max_images": 2}) as s:
        yield s


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _source() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8))


def _openai_mask(size=(W, H)) -> Image.Image:
    """OpenAI's format: opaque everywhere but the box to edit (alpha 0)."""
    rgba = np.full((size[1], size[0], 4), 255, dtype=np.uint8)
    rgba[8:24, 16:40, 3] = 0
    return Image.fromarray(rgba, mode="RGBA")


def test_inpaint_with_openai_mask_equals_the_offline_fill(server, flux_fill_dir):
    client = server.client()
    res = client.images.edit(image=("src.png", _png(_source()), "image/png"), prompt="a green square",
                             mask=("mask.png", _png(_openai_mask()), "image/png"), extra_body={"steps": 3, "seed": 1})
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))).convert("RGB"))
    assert served.shape == (H, W, 3)  # no size: the image's own
    white = np.zeros((H, W), dtype=np.uint8)
    white[8:24, 16:40] = 255  # alpha 0 -> white (repaint)
    request = OmniRequest(task=TaskType.I2I, inputs=[TextPart(text="a green square"),
                                                     ImagePart(role="reference", data=_source()),
                                                     ImagePart(role="mask", data=Image.fromarray(white))],
                          diffusion=DiffusionParams(steps=3, seed=1), outputs=OutputSpec())
    out = generator(flux_fill_dir).generate(request)
    assert out.status.value == "completed", out.error
    assert np.array_equal(served, out.image.image.numpy())


def test_bad_masks_are_400_naming_the_mask(server):
    client = server.client()
    image = ("src.png", _png(_source()), "image/png")
    cases = [
        ({}, "needs a mask"),  # an inpaint model called without a mask
        ({"mask": ("m.png", _png(_openai_mask((W, H + 16))), "image/png")}, "pass a mask of the image's size"),
        ({"mask": ("m.png", _png(_source()), "image/png")}, "without an alpha channel"),
    ]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.images.edit(image=image, prompt="x", extra_body={"steps": 1}, **extra)
        body = err.value.body
        assert err.value.status_code == 400 and body["param"] == "mask" and message in body["message"], body


def test_generations_on_a_fill_model_are_refused(server):
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x", "size": "48x32"}, timeout=60)
    assert r.status_code == 400 and "only edits images" in r.json()["error"]["message"], r.text
