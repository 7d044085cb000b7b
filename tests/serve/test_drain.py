"""Graceful drain. SIGTERM on a real ``omniloop serve`` process: no new admissions, the
in-flight job finishes (drain: finish), the process exits 0. And drain: cancel, on the
same DrainingServer in-process: the running job is cancelled at its next step."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import yaml

from tests.serve.conftest import live_server, wait_ready


def _job(url: str, steps: int) -> str:
    r = httpx.post(f"{url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": steps})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _events_after(lines, signal_fn) -> list[dict]:
    """Read SSE ``lines`` until the job runs, call ``signal_fn``, then read to the end."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if events[-1]["type"] == "progress":
                break
    signal_fn()
    return events + [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_sigterm_lets_the_job_finish_then_exits_0(wan_t2v_dir, tmp_path):
    config = tmp_path / "deploy.yaml"  # a deploy config with a serve: section
    config.write_text(yaml.safe_dump({
        "device": "cpu", "dtype": "float32", "limits": {"max_steps": 1000, "max_pixels": 32 * 32},
        "serve": {"warmup": [{"steps": 1, "height": 32, "width": 32, "num_frames": 5}], "drain": "finish"},
    }))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "server.log").open("w") as log:
        command = [sys.executable, "-m", "omniloop.api.cli", "serve", "--model", str(wan_t2v_dir),
                   "--port", str(port), "--deploy-config", str(config)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    checks = {}

    def sigterm_then_probe():
        proc.send_signal(signal.SIGTERM)
        while (ready := httpx.get(f"{url}/ready")).status_code == 200:  # the job still runs: the server
            time.sleep(0.01)                                              # answers, but admits nothing new
        checks["ready"] = ready.json()["status"]
        checks["late"] = httpx.post(f"{url}/v1/videos", json={"prompt": "late", "size": "32x32", "steps": 1})

    try:
        wait_ready(url, timeout=180)  # a fresh process: imports and a model load, slow on a loaded machine
        video_id = _job(url, steps=100)
        with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=60) as stream:
            events = _events_after(stream.iter_lines(), sigterm_then_probe)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert checks["ready"] == "draining"
    assert checks["late"].status_code == 503 and checks["late"].json()["error"]["code"] == "draining"
    final = events[-1]["output"]
    log = (tmp_path / "server.log").read_text()[-2000:]
    assert final["status"] == "completed" and "video" in final["artifacts"], log
    assert max(e["step"] for e in events if e["type"] == "progress") == 100


def test_drain_cancel_stops_the_running_job_and_the_server(wan_t2v_dir):
    with live_server(wan_t2v_dir, limits={"max_steps": 1000}, serve={"drain": "cancel"}) as live:
        video_id = _job(live.url, steps=1000)
        with httpx.stream("GET", f"{live.url}/v1/videos/{video_id}/events", timeout=60) as stream:
            events = _events_after(stream.iter_lines(), lambda: live.server.handle_exit(signal.SIGTERM, None))
        live.thread.join(timeout=30)
        assert not live.thread.is_alive()  # uvicorn stopped after the drain
    final = events[-1]["output"]
    assert final["status"] == "cancelled" and "video" not in final["artifacts"]
    assert max(e["step"] for e in events if e["type"] == "progress") < 1000
