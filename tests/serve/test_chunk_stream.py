"""A causal video job's chunks reach SSE clients as they are made, each as an fMP4 media
segment a browser's MediaSource can append (real server, the tiny FAR checkpoint)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from tests.serve.conftest import live_server


@pytest.fixture(scope="module")
def far_server(far_dir):
    with live_server(far_dir) as server:
        yield server


def _events(server, video_id: str) -> list[dict]:
    events = []
    with httpx.stream("GET", f"{server.url}/v1/videos/{video_id}/events", timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


def _decode(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_chunks_stream_as_fmp4_segments_before_the_video_completes(far_server):
    r = httpx.post(f"{far_server.url}/v1/videos", json={"prompt": "a red circle", "size": "64x32", "num_frames": 17,
                                                          "steps": 1, "seed": 3})
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    events = _events(far_server, video_id)
    chunks = [e for e in events if e["type"] == "artifact" and e["partial"] and "fmp4" in e]
    final = events[-1]
    assert final["type"] == "final" and final["output"]["status"] == "completed"
    # 17 frames = 5 latent frames in chunks (1, 2, 2): 1 + 8 + 8 video frames, streamed in order
    assert [c["artifact"]["index"] for c in chunks] == [0, 1, 2]
    assert [c["artifact"]["num_frames"] for c in chunks] == [1, 8, 8]
    assert [c["artifact"]["first_frame"] for c in chunks] == [0, 1, 9]
    assert events.index(chunks[-1]) < len(events) - 1  # every chunk came before the final event
    assert "init" in chunks[0]["fmp4"] and all("init" not in c["fmp4"] for c in chunks[1:])
    init = base64.b64decode(chunks[0]["fmp4"]["init"])
    segments = [base64.b64decode(c["fmp4"]["segment"]) for c in chunks]
    for seg, chunk in zip(segments, chunks):
        assert _decode(init + seg).shape == (chunk["artifact"]["num_frames"], 32, 64, 3)
    streamed = _decode(init + b"".join(segments))
    content = httpx.get(f"{far_server.url}/v1/videos/{video_id}/content").content
    whole = _decode(content)  # the job's mp4, encoded once from the whole video
    assert streamed.shape == whole.shape == (17, 32, 64, 3)
    # the same video through two H.264 encodes of noisy frames (random weights): measured 6.6
    # levels apart, where consecutive frames differ by 25
    diff = np.abs(streamed.astype(int) - whole.astype(int)).mean()
    neighbours = np.abs(whole[1:].astype(int) - whole[:-1].astype(int)).mean()
    assert diff < 10 and diff < neighbours / 2, (diff, neighbours)
