"""Graceful drain. SIGTERM on a real ``omniloop serve`` process: no new admissions, the
in-flight job finishes (drain: finish), the process exits 0. And drain: cancel, on the
same DrainingServer in-process: the running job is cancelled at its next step."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.serve.conftest import live_server


# Under load (2 cores, several suites at once) a request can wait seconds for the GIL of a
# process that is stepping the engine: client timeouts are generous, they bound only a hang.
TIMEOUT = 60


def _job(url: str, steps: int) -> str:
    r = httpx.post(f"{url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": steps},
                   timeout=TIMEOUT)
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


def _wait_listening_and_ready(proc: subprocess.Popen, log: Path, limit_s: float = 900) -> str:
    """The server's URL, once it printed its address and then that it is ready. Waits as long
    as the process lives (a fresh process imports torch and loads the model: minutes on a
    loaded machine, which a fixed short deadline once missed); it fails at once, with the
    log, if the process exits, and after ``limit_s`` only if it hangs."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = log.read_text()
        found = re.search(r"omniloop serve: \S+ on (http://127\.0\.0\.1:\d+) ", text)
        if found and "omniloop serve: ready" in text:
            return found.group(1)
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before it was ready:\n{text[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"the server was not ready after {limit_s}s:\n{log.read_text()[-3000:]}")


def test_sigterm_lets_the_job_finish_then_exits_0(wan_t2v_dir, tmp_path):
    config = tmp_path / "deploy.yaml"  # a deploy config with a serve: section
    config.write_text(yaml.safe_dump({
        "device": "cpu", "dtype": "float32", "limits": {"max_steps": 1000, "max_pixels": 32 * 32},
        "serve": {"warmup": [{"steps": 1, "height": 32, "width": 32, "num_frames": 5}], "drain": "finish",
                  # the job's 100 steps may outlast the default 120 s on a loaded 2-core CI machine
                  "drain_timeout_s": 900},
    }))
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:  # port 0: the server binds a free port and prints it (no port race)
        command = [sys.executable, "-u", "-m", "omniloop.api.cli", "serve", "--model", str(wan_t2v_dir),
                   "--port", "0", "--deploy-config", str(config)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    checks = {}
    url = ""

    def sigterm_then_probe():
        proc.send_signal(signal.SIGTERM)
        while (ready := httpx.get(f"{url}/ready", timeout=TIMEOUT)).status_code == 200:  # the job still runs:
            time.sleep(0.01)                                          # the server answers, but admits nothing new
        checks["ready"] = ready.json()["status"]
        checks["late"] = httpx.post(f"{url}/v1/videos", json={"prompt": "late", "size": "32x32", "steps": 1},
                                    timeout=TIMEOUT)

    try:
        url = _wait_listening_and_ready(proc, log_path)
        assert httpx.get(f"{url}/ready", timeout=TIMEOUT).status_code == 200
        video_id = _job(url, steps=100)
        with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=TIMEOUT) as stream:
            events = _events_after(stream.iter_lines(), sigterm_then_probe)
        assert proc.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert checks["ready"] == "draining"
    assert checks["late"].status_code == 503 and checks["late"].json()["error"]["code"] == "draining"
    final = events[-1]["output"]
    log = log_path.read_text()[-2000:]
    assert final["status"] == "completed" and "video" in final["artifacts"], log
    assert max(e["step"] for e in events if e["type"] == "progress") == 100
    assert f"omniloop serve: ready\nomniloop serve: try {url}/docs (every route, callable from the page), or the " \
           f"openai client with base_url {url}/v1; Ctrl-C stops\n" in log  # what next (no session model: no /play)
    # the signal is answered at once (a user who pressed Ctrl-C sees why the server is still up), then the end
    assert "omniloop serve: stopping: in-flight jobs finish first (up to 900 s); a second Ctrl-C stops at once" in log
    assert log.rstrip().endswith("omniloop serve: stopped"), log


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
