"""Every bad input is a 4xx whose error names the field (``param`` and the message)."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from omniloop.engine import AsyncEngine
from omniloop.serve.app import create_app
from omniloop.serve.config import ServeConfig

OK = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 2}


def _error(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"], error
    return error["message"]


@pytest.mark.parametrize("change,status,param,says", [
    ({"model": "sora-2"}, 404, "model", "not served here"),
    ({"size": "40x32"}, 400, "size", "multiple of 16; pass 32 or 48"),
    ({"size": "32 by 32"}, 400, "size", "pattern"),
    ({"size": "128x128"}, 400, "size", "limits.max_pixels"),
    ({"steps": 0}, 400, "steps", "greater than or equal to 1"),
    ({"steps": 5000}, 400, "steps", "less than or equal to 1000"),
    ({"steps": 5}, 400, "steps", "limits.max_steps"),
    ({"steps": 2, "num_inference_steps": 3}, 400, "steps", "disagrees"),
    ({"guidance_scale": 2.0, "guidance": 3.0}, 400, "guidance_scale", "disagrees with guidance=3.0"),
    ({"num_frames": 6}, 400, "num_frames", "4k+1; pass 5 or 9"),
    ({"num_frames": 13}, 400, "num_frames", "limits.max_frames"),
    ({"num_frames": None, "seconds": 60}, 400, "seconds", "limits.max_frames"),
    ({"seconds": 1}, 400, "seconds", "not both"),
    ({"guidance_scale": -1}, 400, "guidance_scale", "must be >= 0"),
    ({"sampler": "ddim"}, 400, "sampler", "ddim"),
    ({"seed": -1}, 400, "seed", "greater than or equal to 0"),
    ({"prompt": ""}, 400, "prompt", "pass a non-empty text prompt (got an empty string)"),
    ({"prompt": "  "}, 400, "prompt", "pass a non-empty text prompt (got only whitespace)"),
    ({"stepz": 3}, 400, "stepz", "unknown field"),
    ({"stg_scale": 2.0}, 400, "stg_scale", "nor a knob of 'wan_t2v"),  # LTX-2's loop knob, not Wan's
    ({"input_reference": {"image_url": "file:///etc/passwd"}}, 400, "input_reference.image_url", "data: URLs"),
])
def test_bad_video_fields(strict_server, change, status, param, says):
    body = {k: v for k, v in {**OK, **change}.items() if v is not None}
    assert says in _error(httpx.post(f"{strict_server.url}/v1/videos", json=body), status, param)


@pytest.mark.parametrize("change,param,says", [
    ({"n": 3}, "n", "limits.max_images"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"size": "24x24"}, "size", "multiple of 16"),
    ({"response_format": "gif"}, "response_format", "'b64_json' or 'url'"),
    ({"output_format": "jpeg"}, "output_format", "'png'"),
    ({"stream": True}, "stream", "False"),
    ({"model": "dall-e-3"}, "model", "not served here"),
])
def test_bad_image_fields(strict_server, change, param, says):
    body = {"prompt": "a cat", "size": "32x32", "steps": 2, **change}
    status = 404 if param == "model" else 400
    assert says in _error(httpx.post(f"{strict_server.url}/v1/images/generations", json=body), status, param)


def test_malformed_bodies(strict_server):
    url = f"{strict_server.url}/v1/videos"
    _error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "body")
    _error(httpx.post(url, json=["a", "list"]), 400, "body")
    _error(httpx.post(url, content=b"x", headers={"content-type": "text/plain"}), 415, "content-type")
    _error(httpx.post(url, json={**OK, "negative_prompt": "x" * 70_000}), 413, "body")
    big = httpx.post(url, data={"prompt": "a cat"}, files={"input_reference": ("a.png", b"0" * 70_000, "image/png")})
    _error(big, 413, "body")
    _error(httpx.post(url, data={"prompt": "a cat"}, files={"other": ("a.png", b"0", "image/png")}), 400, "other")
    _error(httpx.post(url, data={"prompt": "a cat", "guidance_scale[video][x]": "1"}), 400, "guidance_scale")


def test_server_survives_and_counts_rejections(strict_server):
    r = httpx.post(f"{strict_server.url}/v1/videos", json=OK)
    assert r.status_code == 200 and strict_server.wait_finished(r.json()["id"])["status"] == "completed"
    assert httpx.get(f"{strict_server.url}/ready").status_code == 200
    assert 'omniloop_requests_rejected_total{code="400",kind="video"}' in httpx.get(f"{strict_server.url}/metrics").text


def test_api_key_and_draining(wan_t2v_dir):
    engine = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    try:
        app = create_app(engine, ServeConfig(api_key="s3cret", warmup=[]))
        client = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: nothing runs, admission paths only
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key
        app.state.omniloop.draining = True
        r = client.post("/v1/videos", json=OK, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 503 and r.headers["retry-after"] and "draining" in r.json()["error"]["message"]
        assert client.get("/ready").json()["status"] == "draining"
    finally:
        engine.shutdown()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("change", [{"guidance_scale": 1e300}, {"shift": 1e-300}])
def test_overflowing_parameters_are_422_not_500(strict_server, change):
    body = {"prompt": "a cat", "size": "32x32", "steps": 2, **change}
    r = httpx.post(f"{strict_server.url}/v1/images/generations", json=body)
    message = r.json()["error"]["message"]
    assert r.status_code == 422 and "non-finite" in message and "guidance_scale" in message


def test_loop_knobs_come_flat_and_are_checked_by_their_loops_schema(strict_server):
    """A served model's loop knob is a flat field (Wan's denoise loop: guidance_scale_2), checked
    by the loop's schema under the name sent; a knob its loops lack is a 400 naming it, the
    model and the knobs they have. /openapi.json lists the knobs as the body's properties."""
    url = f"{strict_server.url}/v1/videos"
    ok = httpx.post(url, json={**OK, "guidance_scale_2": 3.0})
    assert ok.status_code == 200 and strict_server.wait_finished(ok.json()["id"])["status"] == "completed"
    assert "greater than or equal to 0" in _error(httpx.post(url, json={**OK, "guidance_scale_2": -1}), 400,
                                                  "guidance_scale_2")
    message = _error(httpx.post(url, json={**OK, "audio_guidance_scale": 5.0}), 400, "audio_guidance_scale")
    assert "(its loop knobs: guidance_scale_2)" in message, message
    body = httpx.get(f"{strict_server.url}/openapi.json").json()["components"]["schemas"]["VideoCreateRequest"]
    assert "guidance_scale_2" in body["properties"] and body["additionalProperties"] is False
