"""Wan-Animate over /v1/videos: the character as reference_images[0], the pose and face videos
as pose_video / face_video (multipart uploads or JSON data: URLs: the same video either way),
and a missing driving video refused naming its field."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from omniloop.io.video import encode_mp4
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server
from tests.serve.test_vace_videos import _thumbnail, _url

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
H, W, F = 32, 48, 5
FIELDS = {"prompt": "a red circle moving right", "size": f"{W}x{H}", "steps": 2, "seed": 9}


@pytest.fixture(scope="module")
def animate_server(wan_animate_dir):
    with live_server(wan_animate_dir, limits={"max_steps": 8, "max_frames": 9, "max_pixels": 64 * 64},
                     serve={"warmup": []}) as server:
        yield server


def _mp4(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_mp4(rng.integers(0, 256, size=(F, H, W, 3), dtype=np.uint8), fps=16, crf=0)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, size=(40, 24, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_pose_and_face_videos_multipart_equals_json(animate_server):
    pose, face, ref = _mp4(1), _mp4(2), _png()
    files = [("pose_video", ("p.mp4", pose, "video/mp4")), ("face_video", ("f.mp4", face, "video/mp4")),
             ("reference_images", ("r.png", ref, "image/png"))]
    upload = httpx.post(f"{animate_server.url}/v1/videos", data={k: str(v) for k, v in FIELDS.items()}, files=files)
    assert upload.status_code == 200, upload.text
    inline = httpx.post(f"{animate_server.url}/v1/videos", json={
        **FIELDS, "pose_video": _url("video/mp4", pose), "face_video": _url("video/mp4", face),
        "reference_images": [_url("image/png", ref)]})
    assert inline.status_code == 200, inline.text
    assert _thumbnail(animate_server, upload.json()["id"]) == _thumbnail(animate_server, inline.json()["id"])


def test_missing_face_video_is_refused_naming_it(animate_server):
    r = httpx.post(f"{animate_server.url}/v1/videos", json={
        **FIELDS, "pose_video": _url("video/mp4", _mp4(1)), "reference_images": [_url("image/png", _png())]})
    assert r.status_code in (400, 422), r.text
    body = r.json()["error"]
    assert body["param"] == "face_video" and "role='face'" in body["message"], body
