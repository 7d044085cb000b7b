"""The weight plane over HTTP: a real server on 127.0.0.1 (tiny Wan), ``--weights-dir`` and an
API key; weights pushed as a path (the official openai client's raw POST) and as a multipart
upload (httpx); outputs change, then the original file brings back the same mp4 byte for byte;
refusals (401, 403, 400 naming the field) leave the old weights served; sleep / wake."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.media import assert_same_video, frame_diff
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CKPT = "transformer/diffusion_pytorch_model.safetensors"
PARAMS = {"steps": 2, "num_frames": 5, "seed": 3}


@pytest.fixture(scope="module")
def weights_dir(wan_t2v_dir, tmp_path_factory):
    """The served model's transformer file, and a perturbed copy, under the same layout."""
    root = tmp_path_factory.mktemp("weights")
    (root / "transformer").mkdir()
    shutil.copy(wan_t2v_dir / CKPT, root / CKPT)
    sd = load_file(str(wan_t2v_dir / CKPT))
    gen = torch.Generator().manual_seed(1)
    save_file({k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in sd.items()},
              str(root / "transformer" / "perturbed.safetensors"))
    save_file({"proj_out.weight": torch.zeros(3, 3)}, str(root / "bad.safetensors"))
    (tmp_path_factory.getbasetemp() / "outside.safetensors").write_bytes((root / CKPT).read_bytes())
    return root


@pytest.fixture(scope="module")
def server(wan_t2v_dir, weights_dir):
    with live_server(wan_t2v_dir, serve={"api_key": KEY, "weights_dir": str(weights_dir)}) as s:
        yield s


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _video(server) -> tuple[bytes, str]:
    client = _client(server)
    video = client.videos.create(prompt="a red circle moving right", size="32x32", extra_body=PARAMS)
    deadline = time.monotonic() + 120
    while (video := client.videos.retrieve(video.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert video.status == "completed", video
    return client.videos.download_content(video.id).content, video.model_extra["weight_version"]


def _push(server, **body) -> dict:
    return _client(server).post("/weights", body=body, cast_to=object)


def test_push_by_path_and_upload_then_back_to_the_original_bit_for_bit(server, weights_dir):
    original, version = _video(server)
    assert version == "0"
    out = _push(server, path="transformer/perturbed.safetensors", version="1")
    assert out["version"] == "1" and out["component"] == "transformer" and out["copied_tensors"] > 0
    changed, version = _video(server)
    assert version == "1" and frame_diff(changed, original)[0] > 5
    with open(weights_dir / CKPT, "rb") as f:  # the original weights as a multipart upload
        r = httpx.post(f"{server.url}/v1/weights", headers=AUTH, files={"file": f},
                       data={"version": "2", "role": "ema"}, timeout=60)
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["role"]) == ("2", "ema")
    back, version = _video(server)
    assert version == "2"
    assert_same_video(back, original)
    got = httpx.get(f"{server.url}/v1/weights", headers=AUTH).json()
    assert (got["version"], got["role"]) == ("2", "ema") and got["updated_at"] > 0
    metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert 'omniloop_weight_version{role="ema",version="2"} 1.0' in metrics
    assert "omniloop_weight_updates_total 2.0" in metrics


def test_refusals_name_the_field_and_keep_the_old_weights(server):
    before = httpx.get(f"{server.url}/v1/weights", headers=AUTH).json()["version"]
    r = httpx.post(f"{server.url}/v1/weights", json={"path": CKPT, "version": "99"})  # no key
    assert r.status_code == 401
    for path in ("../outside.safetensors", "/etc/passwd"):
        r = httpx.post(f"{server.url}/v1/weights", headers=AUTH, json={"path": path, "version": "99"})
        assert r.status_code == 403 and r.json()["error"]["param"] == "path", r.text
    with pytest.raises(openai.BadRequestError, match="proj_out.weight") as err:
        _push(server, path="bad.safetensors", version="99")
    assert err.value.body["param"] == "path"
    with pytest.raises(openai.BadRequestError, match="not newer") as err:
        _push(server, path=CKPT, version="0")
    assert err.value.body["param"] == "version"
    r = httpx.post(f"{server.url}/v1/weights", headers=AUTH, files={"file": ("w.safetensors", b"not a file")},
                   data={"version": "99"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    r = httpx.post(f"{server.url}/v1/weights", headers=AUTH, json={"path": CKPT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    assert httpx.get(f"{server.url}/v1/weights", headers=AUTH).json()["version"] == before


def test_sleep_and_wake(server):
    before, _ = _video(server)
    r = httpx.post(f"{server.url}/v1/sleep", headers=AUTH, json={"level": 1}, timeout=60)
    assert r.status_code == 200 and "transformer" in r.json()["components"], r.text
    assert httpx.get(f"{server.url}/v1/weights", headers=AUTH).json()["asleep"] == 1
    r = httpx.post(f"{server.url}/v1/sleep", headers=AUTH, json={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert httpx.post(f"{server.url}/v1/wake").status_code == 401
    client = _client(server)
    waiting = client.videos.create(prompt="a red circle moving right", size="32x32", extra_body=PARAMS)
    time.sleep(0.5)
    assert client.videos.retrieve(waiting.id).status == "queued"  # while_asleep: wait (the default)
    r = httpx.post(f"{server.url}/v1/wake", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while client.videos.retrieve(waiting.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the same video (decoded frames: an ulp can flip one x264 decision, tests/media.py); the outputs
    # after wake are bit-equal in process (tests/engine/test_weights.py)
    assert_same_video(client.videos.download_content(waiting.id).content, before)
    after, _ = _video(server)
    assert_same_video(after, before)


def test_asleep_requests_get_503_with_retry_after(wan_t2v_dir):
    with live_server(wan_t2v_dir, serve={"while_asleep": "reject", "warmup": []}) as s:
        assert httpx.post(f"{s.url}/v1/sleep", timeout=60).status_code == 200
        r = httpx.post(f"{s.url}/v1/videos", json={"prompt": "a red circle", "size": "32x32", **PARAMS})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["error"]["code"] == "asleep"
        assert httpx.post(f"{s.url}/v1/wake", timeout=60).status_code == 200
        r = httpx.post(f"{s.url}/v1/videos", json={"prompt": "a red circle", "size": "32x32", **PARAMS})
        assert r.status_code == 200, r.text
