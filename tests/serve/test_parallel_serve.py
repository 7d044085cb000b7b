"""``serve`` with a parallel deployment (``omniloop serve --parallel cfg=2``; the same
``AsyncEngine.from_pretrained`` path): a real uvicorn server on 127.0.0.1 whose engine is rank 0
of a 2-rank gloo pool, driven by the official ``openai`` client.

The served mp4 is byte-identical to the one-process video (cfg=2 is bitwise: each rank runs one
branch's forward, tests/api/test_parallel_generator.py); a rank killed between jobs is a
pool-fatal error the engine recovers from (restart), and the next job is served alike.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from websockets.sync.client import connect
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.io import encode_mp4
from tests.parallel.ranks import rank_threads, threads
from tests.serve.conftest import live_server

PARAMS = dict(steps=3, height=32, width=32, num_frames=5, seed=3, guidance_scale=4.0)
PROMPT = "a red circle moving right"


def _one_process_mp4(model_dir) -> bytes:
    gen = VideoGenerator.from_pretrained(model_dir, device="cpu", dtype="float32")
    with torch.inference_mode(), threads(rank_threads(2)):  # as many threads as each rank
        video = gen.generate_video(PROMPT, save_video=False, **PARAMS)
    return encode_mp4(video.frames, video.fps, title=PROMPT)  # what the server's job runner writes (the prompt as its title)


def _serve_one(server) -> bytes:
    """Rank 0 computes on the server's engine thread, which pins the ranks' thread count itself
    (AsyncEngine(threads=)): the session model's engine, loaded after the pool, sets torch's
    count by ``cpu_threads=auto``, and CPU kernels round differently with another count."""
    client = server.client()
    video = client.videos.create(prompt=PROMPT, size="32x32", extra_body={
        "steps": PARAMS["steps"], "num_frames": PARAMS["num_frames"], "seed": PARAMS["seed"],
        "guidance_scale": PARAMS["guidance_scale"]})
    body = server.wait_finished(video.id, timeout=120)
    assert body["status"] == "completed", body
    return client.videos.download_content(video.id).content


def _one_session(server) -> dict:
    """A session runs while a client watches it: connect, and read its stream to the end."""
    sid = httpx.post(f"{server.url}/v1/sessions", json={"prompt": "a red circle", "size": "64x32", "steps": 1,
                                                         "max_chunks": 2, "realtime": False}, timeout=60).json()["id"]
    with connect(f"ws://127.0.0.1:{server.url.rsplit(':', 1)[1]}/v1/sessions/{sid}/stream") as ws:
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, str) and json.loads(msg)["type"] == "end":
                break
    for _ in range(600):
        body = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
        if body["status"] not in ("queued", "in_progress"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"session {sid} still {body['status']}")


def test_a_parallel_server_serves_the_one_process_video_and_survives_a_dead_rank(wan_t2v_dir, far_dir):
    """With a session model beside it (as ``omniloop serve`` without --model starts the
    interactive one): that engine runs on the server's own process, since the pool holds the
    process's one torch.distributed group."""
    expected = _one_process_mp4(wan_t2v_dir)
    with live_server(wan_t2v_dir, parallel="cfg=2", serve={"session_model": str(far_dir)}) as server:
        engine = server.engine.engine
        assert engine.pool.spec.world == 2
        assert len(server.client().models.list().data) == 2  # the served model (as on one process), the session one
        assert _serve_one(server) == expected
        session = _one_session(server)
        assert session["status"] == "completed" and session["chunks"] == 2, session

        rank1 = engine.pool._procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(timeout=10)
        assert _serve_one(server) == expected  # the pool restarted under the job; same bytes
        assert engine.stats.pool_restarts == 1
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "omniloop_engine_pool_restarts_total 1.0" in metrics
    assert not torch.distributed.is_initialized()  # the server's shutdown stopped the ranks
