"""Several models on one server (issue 19 point 5): ``AsyncEngine.serving_models`` (what
``omniloop serve --model flux=... --model wan=...`` runs) behind the OpenAI API. The
request's ``model`` picks; with a device budget that holds one model, serving the other is
a transition (weights moved in place), and both keep answering."""

from __future__ import annotations

import httpx
import pytest

from omniloop.api.cli import served_models
from omniloop.request import DiffusionParams
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server


@pytest.fixture(scope="module")
def server(flux_dir, wan_t2v_dir):
    # model_device_gb: ~1 KB, so only one of the two is on the device at a time
    with live_server({"flux": flux_dir, "wan": wan_t2v_dir}, model_device_gb=1e-6,
                     serve={"warmup": [DiffusionParams(steps=1, height=32, width=32)]},
                     limits={"max_steps": 4, "max_images": 4, "max_frames": 9}) as s:
        yield s


@pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
def test_the_model_field_selects_and_switching_is_a_transition(server):
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["flux", "wan"] and "i2i" in models[0]["tasks"]
    client = server.client()
    image = client.images.generate(model="flux", prompt="a red fox", size="32x32", extra_body={"steps": 1, "seed": 1})
    assert image.data[0].b64_json
    video = client.videos.create_and_poll(model="wan", prompt="a clip", size="32x32",
                                          extra_body={"steps": 1, "num_frames": 5}, poll_interval_ms=50)
    assert video.status == "completed" and video.model == "wan", video.error
    again = client.images.generate(prompt="a red fox", size="32x32", extra_body={"steps": 1, "seed": 1})  # the default: flux
    assert again.data[0].b64_json == image.data[0].b64_json  # same weights after moving off and back
    pool = server.engine.engine
    assert pool.pool_stats.transitions >= 2  # flux -> wan -> flux, each charged as a transition
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x", "model": "sdxl"})
    assert r.status_code == 404 and "pass one of ['flux', 'wan']" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": "x", "model": "wan", "image": "aGVsbG8="})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("image", "model")
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'omniloop_text_cache_lookups_total{model="flux",result="hit"}' in metrics
    assert 'omniloop_text_cache_lookups_total{model="wan",result="miss"}' in metrics


def test_serve_flags_name_several_models():
    assert served_models(["flux=/ckpt/FLUX.1-dev", "/ckpt/Wan2.1-T2V"]) == {"flux": "/ckpt/FLUX.1-dev",
                                                                          "Wan2.1-T2V": "/ckpt/Wan2.1-T2V"}
    with pytest.raises(ValueError, match="two models named 'a'"):
        served_models(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="pass MODEL or NAME=MODEL"):
        served_models(["=/x"])
