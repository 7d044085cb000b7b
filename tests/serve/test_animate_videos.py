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


def test_replace_mode_takes_the_background_video_and_mask(animate_server):
    mask = np.zeros((F, H, W, 3), dtype=np.uint8)
    mask[:, 4:20, 8:28] = 255
    body = {**FIELDS, "pose_video": _url("video/mp4", _mp4(1)), "face_video": _url("video/mp4", _mp4(2)),
            "reference_images": [_url("image/png", _png())]}
    replace = httpx.post(f"{animate_server.url}/v1/videos", json={
        **body, "video": _url("video/mp4", _mp4(5)), "mask": _url("video/mp4", encode_mp4(mask, fps=16, crf=0))})
    assert replace.status_code == 200, replace.text
    animate = httpx.post(f"{animate_server.url}/v1/videos", json=body)
    assert _thumbnail(animate_server, replace.json()["id"]) != _thumbnail(animate_server, animate.json()["id"])
    alone = httpx.post(f"{animate_server.url}/v1/videos", json={**body, "video": _url("video/mp4", _mp4(5))})
    assert alone.status_code in (400, 422) and alone.json()["error"]["param"] == "mask", alone.text


def _long_mp4(seed: int, frames: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_mp4(rng.integers(0, 256, size=(frames, H, W, 3), dtype=np.uint8), fps=16, crf=0)


def test_segment_knobs_are_flat_fields(animate_server):
    """A 9-frame pose video in two 5-frame segments (segment_frame_length, a flat field); a
    length that is not 4k+1 refused naming the field."""
    videos = {"pose_video": _url("video/mp4", _long_mp4(1, 9)), "face_video": _url("video/mp4", _long_mp4(2, 9)),
              "reference_images": [_url("image/png", _png())]}
    r = httpx.post(f"{animate_server.url}/v1/videos", json={**FIELDS, **videos, "segment_frame_length": 5,
                                                            "prev_segment_conditioning_frames": 1})
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{animate_server.url}/v1/videos", json={**FIELDS, **videos, "segment_frame_length": 6})
    assert bad.status_code in (400, 422), bad.text
    body = bad.json()["error"]
    assert "segment_frame_length" in body["param"] and "4k+1" in body["message"], body
