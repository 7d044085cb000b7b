"""A job's OmniEvents over SSE and WebSocket, and DELETE cancelling a running job."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect


def _create(server, **fields) -> str:
    body = {"prompt": "a green triangle bouncing", "size": "32x32", "num_frames": 5, **fields}
    r = httpx.post(f"{server.url}/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _sse(server, video_id: str) -> list[dict]:
    events = []
    with httpx.stream("GET", f"{server.url}/v1/videos/{video_id}/events", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == kind and event["request_id"] == video_id and event["schema_version"]
                events.append(event)
    return events


def _ws(server, video_id: str) -> tuple[list[dict], int]:
    events = []
    with connect(f"ws://127.0.0.1:{server.url.rsplit(':', 1)[1]}/v1/videos/{video_id}/events") as ws:
        try:
            while True:
                events.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed as closed:
            return events, closed.rcvd.code


def test_sse_streams_status_progress_previews_final(t2v_server):
    video_id = _create(t2v_server, steps=4, preview_every=2)
    events = _sse(t2v_server, video_id)  # connects while the job runs, or replays it
    types = [e["type"] for e in events]
    assert types[0] == "status" and events[0]["status"] == "queued" and events[0]["predicted_cost_s"] > 0
    assert [e["step"] for e in events if e["type"] == "progress"] == [1, 2, 3, 4]
    previews = [e for e in events if e["type"] == "artifact" and e["partial"]]
    assert [p["artifact"]["step"] for p in previews] == [2]  # every 2 steps, not after the last
    assert types[-1] == "final" and events[-1]["output"]["status"] == "completed"
    assert events[-1]["output"]["artifacts"]["video"]["num_frames"] == 5


def test_websocket_streams_the_same_events(t2v_server):
    video_id = _create(t2v_server, steps=3)
    live, code = _ws(t2v_server, video_id)
    assert code == 1000 and live[-1]["type"] == "final" and live[-1]["output"]["status"] == "completed"
    assert _ws(t2v_server, video_id)[0] == live == _sse(t2v_server, video_id)  # replays are identical
    assert _ws(t2v_server, "video_nope") == ([], 4404)


def test_delete_cancels_a_running_job_at_its_next_step(t2v_server):
    video_id = _create(t2v_server, steps=1000)
    deadline = time.monotonic() + 30
    while httpx.get(f"{t2v_server.url}/v1/videos/{video_id}").json()["progress"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    steps_before = t2v_server.engine.stats()["steps"]
    r = httpx.delete(f"{t2v_server.url}/v1/videos/{video_id}", timeout=60)
    # answered before the job stopped (no wait for its next step boundary)
    assert r.status_code == 200 and r.json() == {"id": video_id, "object": "video.deleted", "deleted": False,
                                                 "status": "cancelling"}
    job = t2v_server.wait_finished(video_id)
    assert t2v_server.engine.stats()["steps"] - steps_before < 50  # stopped at a step boundary, not at 1000
    assert job["status"] == "cancelled" and 1 <= job["progress"] < 100
    events = _sse(t2v_server, video_id)
    assert events[-1]["output"]["status"] == "cancelled"
    assert max(e["step"] for e in events if e["type"] == "progress") < 1000
    assert httpx.get(f"{t2v_server.url}/v1/videos/{video_id}/content").status_code == 409
    again = httpx.delete(f"{t2v_server.url}/v1/videos/{video_id}").json()
    assert again["deleted"] is True and httpx.get(f"{t2v_server.url}/v1/videos/{video_id}").status_code == 404


@pytest.mark.parametrize("path", ["", "/events", "/content"])
def test_unknown_job_is_404(t2v_server, path):
    r = httpx.get(f"{t2v_server.url}/v1/videos/video_nope{path}")
    assert r.status_code == 404 and "video_nope" in r.json()["error"]["message"]
