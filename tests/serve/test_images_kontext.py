"""``/v1/images/edits`` on a FLUX.1 Kontext model: a live server on 127.0.0.1 over the tiny
Kontext checkpoint, driven by the official openai client. The edit runs with the upload as
the reference; what the server returns equals the offline API's output on the same weights
(PNG bytes decoded: uint8 equal), which tests/models/flux/test_kontext.py ties to diffusers.
The Kontext resolutions are swapped for small ones (as there) so the reference stays tiny."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from omniloop.api.generator import VideoGenerator
from omniloop.models.families.flux import kontext
from omniloop.request import DiffusionParams
from tests.serve.conftest import live_server

SMALL = [(32, 64), (48, 48), (64, 32)]  # (width, height)


@pytest.fixture(scope="module")
def small_resolutions():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kontext, "KONTEXT_RESOLUTIONS", SMALL)
        yield


@pytest.fixture(scope="module")
def server(flux_kontext_dir, small_resolutions):
    with live_server(flux_kontext_dir, serve={"warmup": [DiffusionParams(steps=1, height=32, width=32)]},
                     limits={"max_steps": 4, "max_images": 2}) as s:
        yield s


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_edit_on_kontext_equals_the_offline_api(server, flux_kontext_dir, small_resolutions):
    source = np.random.default_rng(0).integers(0, 256, (30, 62, 3), dtype=np.uint8)  # aspect ~2: reference 64x32
    res = server.client().images.edit(image=("src.png", _png(source), "image/png"), prompt="make it green",
                                      extra_body={"steps": 2, "seed": 1})
    edited = _pixels(res.data[0].b64_json)
    assert edited.shape == (32, 64, 3)  # no size: the reference's Kontext size
    offline = VideoGenerator.from_pretrained(flux_kontext_dir, device="cpu", dtype="float32")
    want = offline.generate_image("make it green", image=source, steps=2, seed=1, save_image=False).image
    assert np.array_equal(edited, want)
    sized = server.client().images.edit(image=("src.png", _png(source), "image/png"), prompt="make it green",
                                        size="48x32", extra_body={"steps": 1, "seed": 1})
    assert _pixels(sized.data[0].b64_json).shape == (32, 48, 3)  # an asked size is the output's


@pytest.mark.parametrize("path, body, param, message", [
    ("edits", {"prompt": "x"}, "image", "an edit needs the image to edit"),
    ("generations", {"prompt": "x", "size": "32x32"}, "model", "only edits images (tasks: ['i2i']); send the image"),
    ("edits", {"prompt": "x", "image": "data:image/png;base64," + base64.b64encode(
        _png(np.zeros((32, 32, 3), np.uint8))).decode(), "strength": 0.5, "steps": 1}, "strength",
     "does not apply to FLUX.1 Kontext"),
])
def test_bad_kontext_requests_are_400_naming_the_field(server, path, body, param, message):
    r = httpx.post(f"{server.url}/v1/images/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
