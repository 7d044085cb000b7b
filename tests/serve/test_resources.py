"""Resources released (issue 29 item 6): a deleted LoRA's uploaded file leaves the disk once
no request holds it, registrations are capped, an image generation is cancelled by DELETE or
by its client going away, and ``Idempotency-Key`` makes a retried POST return the job it
already made (another body under the same key: 409)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from omniloop.request import DiffusionParams, RequestStatus
from omniloop.serve.jobs import JobKind
from tests.serve.conftest import live_server


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    from tests.flux_checkpoint import save_flux_loras

    return save_flux_loras(tmp_path_factory.mktemp("loras"))


def _upload(server, name, path):
    with open(path, "rb") as f:
        return httpx.post(f"{server.url}/v1/loras", data={"name": name},
                          files={"file": ("lora.safetensors", f, "application/octet-stream")}, timeout=60)


def test_a_deleted_lora_leaves_the_disk_and_registrations_are_capped(flux_dir, lora_files):
    warmup = [DiffusionParams(steps=1, height=32, width=32)]
    with live_server(flux_dir, serve={"warmup": warmup, "max_loras": 1}, limits={"max_steps": 4}) as server:
        for _ in range(3):  # upload/delete cycles leave nothing behind
            assert _upload(server, "detail", lora_files["detail"]).status_code == 200
            upload_dir = server.state.lora_upload_dir
            assert len(list(upload_dir.iterdir())) == 1
            refused = _upload(server, "other", lora_files["detail"])
            assert refused.status_code == 409 and "max_loras" in refused.json()["error"]["message"]
            assert httpx.delete(f"{server.url}/v1/loras/detail").status_code == 200
            assert list(upload_dir.iterdir()) == []


@pytest.fixture(scope="module")
def server(wan_t2v_dir):
    with live_server(wan_t2v_dir, limits={"max_steps": 1000, "max_frames": 9, "max_pixels": 64 * 64}) as s:
        yield s


# Long enough that no machine finishes it before the client below gives up (1000 steps at
# 32x32 once did, within the 3 s read timeout, on an idle machine: 64x64 is ~2x the time, and the
# client below now gives up after 1 s); every test here cancels it early.
LONG_IMAGE = {"prompt": "a cat", "size": "64x64", "steps": 1000}


def _running_image(server, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = [j for j in server.state.jobs.unfinished() if j.kind is JobKind.IMAGE]
        if jobs:
            return jobs[0]
        time.sleep(0.02)
    raise AssertionError("no image job started")


def test_delete_cancels_a_running_image_and_its_call_answers_so(server):
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(r=httpx.post(
        f"{server.url}/v1/images/generations", json=LONG_IMAGE, timeout=120)))
    thread.start()
    job = _running_image(server)
    r = httpx.delete(f"{server.url}/v1/images/{job.id}")
    assert r.status_code == 200 and r.json()["status"] == "cancelling" and r.json()["deleted"] is False
    thread.join(timeout=60)
    assert answer["r"].status_code == 503 and "cancelled" in answer["r"].text
    assert job.status is RequestStatus.CANCELLED
    assert httpx.delete(f"{server.url}/v1/images/{job.id}").json()["deleted"] is True


def test_a_client_that_goes_away_cancels_its_images(server):
    gone = {}

    def call() -> None:
        try:
            gone["answer"] = httpx.post(f"{server.url}/v1/images/generations", json=LONG_IMAGE,
                                        timeout=httpx.Timeout(60, read=1))
        except httpx.ReadTimeout as e:
            gone["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    job = _running_image(server)
    thread.join(timeout=60)
    assert "error" in gone, gone  # the client gave up and closed its connection
    deadline = time.monotonic() + 30
    while not job.sealed:
        assert time.monotonic() < deadline, f"{job.id} still runs after its client left"
        time.sleep(0.05)
    assert job.status is RequestStatus.CANCELLED and job.progress < 100


def test_an_idempotency_key_returns_the_same_job_and_another_body_is_409(server):
    body = {"prompt": "a cat", "size": "32x32", "steps": 1, "num_frames": 5}
    key = {"Idempotency-Key": "retry-7"}
    first = httpx.post(f"{server.url}/v1/videos", json=body, headers=key, timeout=60)
    again = httpx.post(f"{server.url}/v1/videos", json=body, headers=key, timeout=60)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    other = httpx.post(f"{server.url}/v1/videos", json={**body, "prompt": "a dog"}, headers=key, timeout=60)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"
    fresh = httpx.post(f"{server.url}/v1/videos", json=body, headers={"Idempotency-Key": "retry-8"}, timeout=60)
    assert fresh.json()["id"] != first.json()["id"]
    assert server.wait_finished(first.json()["id"])["status"] == "completed"
