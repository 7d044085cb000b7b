"""Structure-controlled generation over ``/v1/images/generations`` with ``control_image`` on a
FLUX.1 Canny/Depth model: a live server on 127.0.0.1 over the tiny control checkpoint
(tests/flux_checkpoint.py), driven by the official openai client (``extra_body``) and httpx.
The server's PNG equals the offline API's output for the same control image (which
tests/models/flux/test_control.py ties to diffusers' FluxControlPipeline bit for bit)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import generator
from tests.models.flux.test_control import _edges
from tests.serve.conftest import live_server

H, W = 32, 48
WARMUP = [DiffusionParams(steps=1, height=32, width=32)]


@pytest.fixture(scope="module")
def server(flux_control_dir):
    with live_server(flux_control_dir, serve={"warmup": WARMUP}, limits={"max_steps": 4, "max_images": 2}) as s:
        yield s


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_generation_with_control_image_equals_the_offline_api(server, flux_control_dir):
    client = server.client()
    res = client.images.generate(prompt="a green square", size=f"{W}x{H}",
                                 extra_body={"control_image": _data_url(_edges()), "steps": 3, "seed": 1})
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))).convert("RGB"))
    request = OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="a green square"),
                                                     ImagePart(role="control", data=_edges())],
                          diffusion=DiffusionParams(steps=3, seed=1, height=H, width=W), outputs=OutputSpec())
    out = generator(flux_control_dir).generate(request)
    assert out.status.value == "completed", out.error
    assert served.shape == (H, W, 3) and np.array_equal(served, out.image.image.numpy())


@pytest.mark.parametrize("path, body, message", [
    ("generations", {"prompt": "x", "size": "48x32"}, "pass control_image"),  # the control model without one
    ("generations", {"prompt": "x", "size": "48x32", "control_image": "aGVsbG8="}, "cannot read image"),
    ("generations", {"prompt": "x", "size": "48x32", "control_image": "https://example.com/e.png"}, "data: URLs"),
    ("edits", {"prompt": "x", "image": _data_url(_edges()), "control_image": _data_url(_edges())}, "does not edit"),
])
def test_bad_control_images_are_400_naming_the_field(server, path, body, message):
    r = httpx.post(f"{server.url}/v1/images/{path}", json=body, timeout=60)
    error = r.json()["error"]
    want = "model" if path == "edits" else "control_image"
    assert r.status_code == 400 and error["param"] == want and message in error["message"], error
    ok = httpx.get(f"{server.url}/ready", timeout=10)
    assert ok.status_code == 200  # the server still serves
