"""The official openai client, unmodified, against the live server."""

from __future__ import annotations

import base64
import io

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import IGNORE_SORA_DEPRECATION

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)


def _decode_mp4(data: bytes):
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        return np.stack(frames), stream.codec_context.name, float(stream.average_rate)


def test_videos_create_retrieve_list_download_delete(t2v_server):
    client = t2v_server.client()
    video = client.videos.create(prompt="a red circle moving right", size="48x32", seconds="0.5",
                                 extra_body={"num_inference_steps": 3, "seed": 7, "guidance_scale": 4.5, "fps": 8})
    assert video.object == "video" and video.status in ("queued", "in_progress") and video.size == "48x32"
    assert video.model_extra["num_frames"] == 5  # 0.5 s at 8 fps -> 4 frames -> the nearest 4k+1
    t2v_server.wait_finished(video.id)

    done = client.videos.retrieve(video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert done.model_extra["metrics"]["seed"] == 7 and done.model_extra["metrics"]["steps"] == 3

    other = client.videos.create(prompt="a blue square", size="32x32", extra_body={"steps": 2, "num_frames": 5})
    t2v_server.wait_finished(other.id)
    listed = [v.id for v in client.videos.list(order="desc", limit=1)]  # auto-paginates one per page
    assert listed.index(other.id) < listed.index(video.id)
    page = client.videos.list(order="asc", after=video.id, limit=100)
    assert video.id not in [v.id for v in page.data] and other.id in [v.id for v in page.data]

    content = client.videos.download_content(video.id)
    frames, codec, fps = _decode_mp4(content.content)
    assert codec == "h264" and frames.shape == (5, 32, 48, 3) and fps == 8.0
    thumb = client.videos.download_content(video.id, variant="thumbnail")
    assert Image.open(io.BytesIO(thumb.content)).size == (48, 32)

    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.object == "video.deleted"
    assert httpx.get(f"{t2v_server.url}/v1/videos/{video.id}").status_code == 404


def test_images_b64_and_url_and_n_batched(t2v_server):
    client = t2v_server.client()
    batched_before = t2v_server.engine.stats()["batched_steps"]
    result = client.images.generate(prompt="a yellow star", size="32x32", n=2, response_format="b64_json",
                                    extra_body={"steps": 3, "seed": 11})
    assert len(result.data) == 2 and result.size == "32x32"
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in result.data]
    assert all(img.shape == (32, 32, 3) for img in images)
    assert not np.array_equal(images[0], images[1])  # seeds 11 and 12
    assert t2v_server.engine.stats()["batched_steps"] > batched_before  # n requests shared steps

    again = client.images.generate(prompt="a yellow star", size="32x32", response_format="url",
                                   extra_body={"steps": 3, "seed": 11})
    png = httpx.get(again.data[0].url)
    assert png.headers["content-type"] == "image/png"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png.content))), images[0])  # same seed, same image


def test_models_health_ready(t2v_server):
    models = t2v_server.client().models.list()
    assert [m.id for m in models.data] == [t2v_server.state.model.name]
    assert sorted(models.data[0].model_extra["tasks"]) == ["t2i", "t2v", "v2v"]
    assert httpx.get(f"{t2v_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{t2v_server.url}/ready").status_code == 200
