"""``omniloop serve --job-store``: a real server process killed (SIGKILL) mid-job and started
again. The completed job is still listed, retrievable and downloadable, byte for byte; the
jobs that were running or queued are ``failed`` saying why (never a 404), or, with
by default (``--no-requeue-on-restart`` fails them), run again to completion. Three server starts in one test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import wait_ready

pytestmark = pytest.mark.slow
BODY = {"prompt": "a cat", "size": "32x32", "num_frames": 5}


class Server:
    def __init__(self, model_dir, tmp_path, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "omniloop.api.cli", "serve", "--model", str(model_dir), "--port",
                   str(self.port), "--device", "cpu", "--dtype", "float32", "--max-running", "1",
                   "--limits", '{"max_steps": 1000}', "--warmup-steps", "1", "--warmup-size", "32x32",
                   "--warmup-frames", "5", "--job-store", str(tmp_path / "jobs.db"), *flags]
        self.log = open(tmp_path / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        wait_ready(self.url, timeout=180)

    def video(self, steps: int) -> str:
        r = httpx.post(f"{self.url}/v1/videos", json={**BODY, "steps": steps})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def get(self, video_id: str) -> dict:
        r = httpx.get(f"{self.url}/v1/videos/{video_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, video_id: str, until, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while not until(body := self.get(video_id)):
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        return body

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def test_killed_twice_completed_jobs_stay_interrupted_ones_fail_or_run_again(wan_t2v_dir, tmp_path):
    first = Server(wan_t2v_dir, tmp_path)
    try:
        done = first.video(steps=2)
        assert first.wait(done, lambda b: b["status"] not in ("queued", "in_progress"))["status"] == "completed"
        mp4 = httpx.get(f"{first.url}/v1/videos/{done}/content").content
        running = first.video(steps=1000)  # seconds: it is mid-run when the process dies
        queued = first.video(steps=2)  # behind it (--max-running 1)
        first.wait(running, lambda b: b["progress"] >= 1)
        assert first.get(queued)["status"] == "queued"
    finally:
        first.kill()

    second = Server(wan_t2v_dir, tmp_path, "--no-requeue-on-restart")  # resuming is the default
    try:
        listed = httpx.get(f"{second.url}/v1/videos", params={"order": "asc"}).json()["data"]
        assert [v["id"] for v in listed] == [done, running, queued]
        again = second.get(done)
        assert again["status"] == "completed" and again["progress"] == 100
        assert httpx.get(f"{second.url}/v1/videos/{done}/content").content == mp4  # byte for byte
        thumb = httpx.get(f"{second.url}/v1/videos/{done}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/png"
        for video_id, was in ((running, "in_progress"), (queued, "queued")):
            body = second.get(video_id)
            assert body["status"] == "failed" and body["error"]["message"].startswith(
                f"the server stopped while this job was {was}; it did not finish: submit it again")
        events = httpx.get(f"{second.url}/v1/videos/{running}/events", timeout=30).text
        assert '"type": "final"' in events and '"status": "failed"' in events
        rerun = second.video(steps=200)
        second.wait(rerun, lambda b: b["progress"] >= 1)
    finally:
        second.kill()

    third = Server(wan_t2v_dir, tmp_path)  # the default: interrupted jobs run again (resuming where they can)
    try:
        body = third.wait(rerun, lambda b: b["status"] in ("completed", "failed", "cancelled"), timeout=600)
        assert body["status"] == "completed" and body["metrics"]["steps"] == 200, body
        assert httpx.get(f"{third.url}/v1/videos/{rerun}/content").headers["content-type"] == "video/mp4"
        assert third.get(running)["status"] == "failed"  # what an earlier restart reported stays
        assert httpx.get(f"{third.url}/v1/videos/{done}/content").content == mp4
    finally:
        third.stop()
