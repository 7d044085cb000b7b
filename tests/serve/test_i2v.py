"""Image-to-video over HTTP: a multipart upload (the openai client's input_reference) and
a JSON data: URL; neither can make the server read a path."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.media import assert_same_video, frame_diff
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)


@pytest.fixture(scope="module")
def i2v_server(wan_i2v_dir):
    with live_server(wan_i2v_dir, limits={"max_steps": 8, "max_frames": 9, "max_pixels": 64 * 64}) as server:
        yield server


def _png(color=(200, 40, 40), size=(48, 32)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), color, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_multipart_upload_with_openai_client(i2v_server):
    client = i2v_server.client()
    video = client.videos.create(prompt="a cat", size="32x32", input_reference=("frame.png", _png(), "image/png"),
                                 extra_body={"steps": 2, "num_frames": 5, "seed": 3})
    assert i2v_server.wait_finished(video.id)["status"] == "completed"
    assert len(client.videos.download_content(video.id).content) > 0


def test_json_data_url_matches_the_upload(i2v_server):
    png = _png((10, 200, 90))
    fields = {"prompt": "a cat", "size": "32x32", "steps": 2, "num_frames": 5, "seed": 4}
    upload = httpx.post(f"{i2v_server.url}/v1/videos", data={k: str(v) for k, v in fields.items()},
                        files={"input_reference": ("f.png", png, "image/png")}).json()["id"]
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    inline = httpx.post(f"{i2v_server.url}/v1/videos",
                        json={**fields, "input_reference": {"image_url": data_url}}).json()["id"]
    a, b = (httpx.get(f"{i2v_server.url}/v1/videos/{v}/content?variant=thumbnail").content
            for v in (i2v_server.wait_finished(upload)["id"], i2v_server.wait_finished(inline)["id"]))
    assert a == b  # same image, same seed, same first frame


@pytest.mark.parametrize("reference,param", [
    ({"image_url": "file:///etc/passwd"}, "input_reference.image_url"),
    ({"image_url": "https://example.com/cat.png"}, "input_reference.image_url"),
    ({"path": "/etc/passwd"}, "input_reference.path"),
    ({"file_id": "file-123"}, "input_reference.file_id"),
    ("/etc/passwd", "input_reference"),
    ({"image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}, "input_reference"),  # decodes, but is no image
])
def test_path_and_remote_inputs_are_refused(i2v_server, reference, param):
    r = httpx.post(f"{i2v_server.url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5,
                                                        "steps": 2, "input_reference": reference})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_multipart_text_path_is_refused(i2v_server):
    r = httpx.post(f"{i2v_server.url}/v1/videos", data={"prompt": "a cat", "input_reference": "/etc/passwd"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_i2v_model_needs_the_image(i2v_server):
    r = httpx.post(f"{i2v_server.url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
    assert "image-to-video" in r.json()["error"]["message"]


def test_first_and_last_frame_over_multipart_and_json(i2v_server):
    """``last_image`` beside ``input_reference`` (Wan2.2 I2V: the last frame in the condition):
    a multipart upload and a JSON data: URL make the same video; the last frame changes it."""
    first, last = _png((10, 200, 90)), _png((200, 20, 200))
    fields = {"prompt": "a cat", "size": "32x32", "steps": 2, "num_frames": 5, "seed": 4}
    url = "data:image/png;base64,"

    def content(video_id: str) -> bytes:  # each request finished before the next is sent: no batch mates
        return httpx.get(f"{i2v_server.url}/v1/videos/{i2v_server.wait_finished(video_id)['id']}/content").content

    a = content(httpx.post(f"{i2v_server.url}/v1/videos", data={k: str(v) for k, v in fields.items()},
                           files={"input_reference": ("f.png", first, "image/png"),
                                  "last_image": ("l.png", last, "image/png")}).json()["id"])
    b = content(httpx.post(f"{i2v_server.url}/v1/videos", json={
        **fields, "input_reference": {"image_url": url + base64.b64encode(first).decode()},
        "last_image": {"image_url": url + base64.b64encode(last).decode()}}).json()["id"])
    c = content(httpx.post(f"{i2v_server.url}/v1/videos", json={
        **fields, "input_reference": {"image_url": url + base64.b64encode(first).decode()}}).json()["id"])
    # the same video (sent in turn: requests sent together batch as their timing falls, and a batched
    # row can round apart from a solo one, tests/media.py); the last frame moves it by levels
    assert_same_video(a, b)
    assert frame_diff(a, c)[0] > 1.0


@pytest.mark.parametrize("body,param,words", [
    ({"last_image": {"image_url": "data:image/png;base64," + base64.b64encode(_png()).decode()}}, "last_image",
     "needs the first frame too"),
    ({"input_reference": {"image_url": "data:image/png;base64," + base64.b64encode(_png()).decode()},
      "last_image": {"image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "last_image", "last_image"),
    ({"input_reference": {"image_url": "data:image/png;base64," + base64.b64encode(_png()).decode()},
      "last_image": {"image_url": "https://example.com/cat.png"}}, "last_image.image_url", "not fetched"),
    ({"input_reference": {"image_url": "data:image/png;base64," + base64.b64encode(_png()).decode()},
      "last_image": {"image_url": "data:image/png;base64," + base64.b64encode(_png(size=(4000, 4000))).decode()}},
     "last_image", "pixels"),
])
def test_bad_last_images_are_refused_naming_last_image(i2v_server, body, param, words):
    r = httpx.post(f"{i2v_server.url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5,
                                                        "steps": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_wan21_i2v_refuses_a_last_image(wan_i2v_clip_dir):
    """A Wan2.1 I2V model (CLIP tokens of one frame) runs the first frame; a last frame is a 400
    naming last_image."""
    png = "data:image/png;base64," + base64.b64encode(_png()).decode()
    with live_server(wan_i2v_clip_dir, limits={"max_steps": 8, "max_frames": 9}) as server:
        body = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 2, "input_reference": {"image_url": png}}
        r = httpx.post(f"{server.url}/v1/videos", json={**body, "last_image": {"image_url": png}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "last_image" and "takes no last frame" in r.json()["error"]["message"]
        ok = httpx.post(f"{server.url}/v1/videos", json=body).json()["id"]
        assert server.wait_finished(ok)["status"] == "completed"
