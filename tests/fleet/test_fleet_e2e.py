"""End to end on loopback: ``python -m dynamo.frontend`` + two ``omniloop dynamo-worker``
processes (file discovery, every DYN_* host 127.0.0.1, free ports), requests over HTTP.

Shows: registration and readiness, round-robin over the two workers, every mp4 decoding
with PyAV, concurrent requests batched inside a worker, 400s carrying our validation
message, images for a T2I-capable model, ``/v1/videos/stream`` frames, a client disconnect
aborting the request in the engine, metrics (queue depth, running, per-request cost) and
loopback-only sockets. Failover and drain are in test_fleet_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import av
import httpx
import pytest
from PIL import Image

from tests.fleet.conftest import requires_dynamo
from tests.fleet.fleet import MODEL, Fleet, listening_addresses
from tests.media import mp4_frames

pytestmark = [pytest.mark.fleet, requires_dynamo]


@pytest.fixture(scope="module")
def fleet(wan_t2v_dir, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"), wan_t2v_dir)
    try:
        f.start_frontend()
        workers = [f.start_worker("worker0"), f.start_worker("worker1")]
        f.wait_ready(workers)
        yield f
    finally:
        f.stop()


async def post_many(fleet: Fleet, n: int, **kwargs) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        bodies = [{"model": MODEL, "prompt": f"clip {i}", "size": "32x32",
                   "nvext": {"num_inference_steps": kwargs.get("steps", 3), "num_frames": 5, "seed": i}}
                  for i in range(n)]
        return await asyncio.gather(*(client.post(f"{fleet.url}/v1/videos", json=b) for b in bodies))


def test_worker_registers_videos_and_images_and_reports_ready(fleet):
    models = httpx.get(f"{fleet.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert fleet.instances("videos") == 2 and fleet.instances("images") == 2
    for w in fleet.workers:
        health = w.health()
        assert health["status"] == "ready" and health["endpoints"] == {"videos": "ready", "images": "ready"}


def test_requests_are_round_robined_and_every_mp4_decodes(fleet):
    before = [w.finished() for w in fleet.workers]
    responses = asyncio.run(post_many(fleet, 8))
    for r in responses:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "completed" and body["model"] == MODEL
        frames = mp4_frames(body["data"][0]["b64_json"])
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    split = [w.finished() - b for w, b in zip(fleet.workers, before)]
    assert split == [4, 4], split


def test_concurrent_requests_are_batched_inside_a_worker(fleet):
    before = [w.metrics()["omniloop_engine_batched_steps_total"] for w in fleet.workers]
    responses = asyncio.run(post_many(fleet, 8, steps=30))
    assert all(r.status_code == 200 and r.json()["status"] == "completed" for r in responses)
    batched = [w.metrics()["omniloop_engine_batched_steps_total"] - b for w, b in zip(fleet.workers, before)]
    assert sum(batched) > 0, batched  # steps of different requests ran in one forward


@pytest.mark.parametrize("fields, status, message", [
    ({"size": "33x32"}, 400, "diffusion.width=33 must be a multiple of 16; pass 32 or 48"),
    ({"nvext": {"num_inference_steps": 0}}, 400, "nvext.num_inference_steps: Input should be greater than or equal to 1"),
    ({"nvext": {"num_frames": 6}}, 400, "diffusion.num_frames=6 must be 4k+1; pass 5 or 9"),
    ({"motion_bucket_id": 127}, 400, "motion_bucket_id: not a field this worker accepts"),
    ({"response_format": "url"}, 400, "response_format: 'url' is not supported"),
])
def test_bad_fields_are_400_with_our_validation_message(fleet, fields, status, message):
    body = {"model": MODEL, "prompt": "x", "size": "32x32", "nvext": {"num_frames": 5}, **fields}
    r = httpx.post(f"{fleet.url}/v1/videos", json=body, timeout=30)
    assert r.status_code == status and r.json()["message"].startswith(message), r.text


def test_images_for_an_image_capable_model(fleet):
    body = {"model": MODEL, "prompt": "a blue square", "size": "32x32", "n": 2, "response_format": "b64_json",
            "nvext": {"num_inference_steps": 2, "seed": 5}}
    r = httpx.post(f"{fleet.url}/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 200, r.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
    assert [(i.format, i.size) for i in images] == [("PNG", (32, 32))] * 2


def test_stream_receives_progress_frames_then_video_frames(fleet):
    body = {"model": MODEL, "prompt": "x", "size": "32x32", "stream": True,
            "nvext": {"num_inference_steps": 6, "num_frames": 5, "seed": 2}}
    arrivals = []
    with httpx.stream("POST", f"{fleet.url}/v1/videos/stream", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("multipart/x-mixed-replace")
        raw = b""
        for chunk in r.iter_bytes():
            raw += chunk
            arrivals.append((time.monotonic(), raw.count(b"--frame\r\n")))
    parts = [p for p in raw.split(b"--frame\r\n") if p]
    jpegs = [p.split(b"\r\n\r\n", 1)[1].rstrip(b"\r\n") for p in parts]
    assert len(jpegs) == 5 + 5  # a progress frame per step but the last, then the 5 video frames
    assert all(Image.open(io.BytesIO(j)).format == "JPEG" for j in jpegs)
    assert arrivals[0][1] < len(jpegs)  # frames arrived as they were made, not in one piece


def test_client_disconnect_aborts_the_request_in_the_engine(fleet):
    before = [(w.finished("cancelled"), w.finished("completed")) for w in fleet.workers]
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as client, pytest.raises(httpx.ReadTimeout):
        fleet.video(client, steps=1000, size=64, frames=17, seed=99)  # ~3 s or more on a CPU
    gone = time.monotonic()

    def aborted() -> bool:
        return sum(w.finished("cancelled") - b[0] for w, b in zip(fleet.workers, before)) == 1

    fleet.wait_until("the abort to reach the engine", aborted, timeout=30)
    latency = time.monotonic() - gone
    for w, (_, completed) in zip(fleet.workers, before):
        m = w.metrics()
        assert m["omniloop_requests_running"] == m["omniloop_requests_waiting"] == 0  # state freed
        assert m["omniloop_inflight_predicted_cost_seconds"] == pytest.approx(0.0, abs=1e-6)
        assert w.finished("completed") == completed  # it was cancelled, not finished
    print(f"disconnect -> engine abort observed in {latency:.2f}s")


def test_metrics_export_queue_depth_running_and_cost(fleet):
    for w in fleet.workers:
        m = w.metrics()
        for name in ("omniloop_requests_waiting", "omniloop_requests_running", "omniloop_engine_steps_total",
                     "omniloop_inflight_predicted_cost_seconds", "omniloop_engine_alive"):
            assert name in m, name
        admitted = m["omniloop_request_predicted_cost_seconds_count"]
        assert admitted >= 4 and m["omniloop_request_predicted_cost_seconds_sum"] > 0
        assert m["omniloop_engine_alive"] == 1 and m["omniloop_engine_accepting"] == 1


def test_cost_annotation_rides_every_response_on_the_request_plane(fleet, tmp_path):
    """Dynamo 1.6.1's frontend drops response keys its schema lacks, so the per-request
    cost is read here the way a router/planner component would: on the request plane."""
    import json
    import subprocess
    import sys

    script = tmp_path / "direct.py"
    script.write_text(
        "import asyncio, json\n"
        "from dynamo.runtime import DistributedRuntime\n"
        "async def main():\n"
        "    rt = DistributedRuntime(asyncio.get_running_loop(), 'file', 'tcp')\n"
        "    client = await rt.endpoint('dynamo.omniloop.videos').client()\n"
        "    await asyncio.wait_for(client.wait_for_instances(), 30)\n"
        f"    body = {{'model': '{MODEL}', 'prompt': 'x', 'size': '32x32', 'nvext': {{'num_frames': 5, 'num_inference_steps': 2}}}}\n"
        "    async for r in await client.round_robin(body):\n"
        "        d = r.data()\n"
        "        print(json.dumps({k: v for k, v in d.items() if k != 'data'}))\n"
        "    rt.shutdown()\n"
        "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, str(script)], env=fleet.env(), capture_output=True, text=True, timeout=60,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-2000:]
    response = json.loads(out.stdout.strip().splitlines()[-1])
    ann = response["nvext"]
    assert response["status"] == "completed" and ann["request_id"] == response["id"]
    assert ann["predicted_cost_s"] > 0 and ann["actual_cost_s"] > 0 and ann["steps"] == 2


def test_every_socket_listens_on_loopback_only(fleet):
    addresses = listening_addresses([p.pid for p in fleet.procs])
    assert addresses, "found no listening sockets"
    assert all(a.rsplit(":", 1)[0] in ("127.0.0.1", "::1") for a in addresses), addresses


def test_registration_publishes_the_roles_the_worker_serves(fleet):
    """The model card in discovery carries the roles (a worker without pools serves "all")."""
    cards = [json.loads(line) for p in (fleet.root / "kv").rglob("*") if p.is_file() and "mdc" in p.parts
             for line in p.read_text().splitlines() if line.strip()]
    videos = [c["card_json"] for c in cards if c.get("endpoint") == "videos"]
    assert len(videos) == 2
    for card in videos:
        runtime = card["runtime_config"]
        assert card["worker_type"] == "aggregated" and runtime["taints"] == ["omniloop.role/all"]
        assert runtime["runtime_data"]["omniloop_roles"] == "all"
        graph = json.loads(runtime["runtime_data"]["omniloop_role_graph"])
        assert {n["role"] for n in graph["nodes"]} == {"all"} and "denoise" in [n["name"] for n in graph["nodes"]]


def test_events_stream_through_the_frontend_concatenates_into_one_mp4(fleet):
    """``stream_format: "events"`` as an extra body field (the frontend passes it in
    ``extra_args.media_passthrough``): the media parts, in order, are one playable mp4."""
    body = {"model": MODEL, "prompt": "x", "size": "32x32", "stream": True, "stream_format": "events",
            "nvext": {"num_inference_steps": 2, "num_frames": 5, "seed": 2}}
    with httpx.stream("POST", f"{fleet.url}/v1/videos/stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read()
    parts = [p.split(b"\r\n\r\n", 1)[1].rstrip(b"\r\n") for p in raw.split(b"--frame\r\n") if p]
    assert len(parts) == 1  # a non-causal model's whole video: one fragment (init + segment), no previews
    with av.open(io.BytesIO(b"".join(parts))) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
