"""``omniloop serve --job-store --requeue-on-restart``: a real server killed (SIGKILL) in the
middle of a job's denoise loop, started again on the same store. The job goes back to
``in_progress`` (the official ``openai`` client polls it), resumes from its last crash
checkpoint (``resumed_from_step``) and completes with the video an uninterrupted run of the
same request makes (its frames; the engine's latents are bit-equal in tests/engine/test_checkpoints.py); its checkpoint file is gone once it has finished."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from tests.media import assert_same_video
from tests.serve.conftest import IGNORE_SORA_DEPRECATION
from tests.serve.test_durable_restart import Server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)]
# 600 steps (~3 s on a 2-core CI box): the kill must land between the first checkpoint (step 10)
# and the end; at 200 steps (~1 s) one loaded CI run polled past the whole window and saw it completed
STEPS, EVERY = 600, 10
ENDED = ("completed", "failed", "cancelled")
FLAGS = ("--requeue-on-restart", "--checkpoint-every-steps", str(EVERY), "--checkpoint-every-s", "0")


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _poll(client: OpenAI, video_id: str, timeout: float = 600) -> tuple[object, list[str]]:
    """Retrieve until the job has ended; (the last video, every status seen in order)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        video = client.videos.retrieve(video_id)
        if not seen or seen[-1] != video.status:
            seen.append(video.status)
        if video.status in ENDED:
            return video, seen
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)


def test_a_job_killed_mid_loop_resumes_from_its_checkpoint_and_equals_an_uninterrupted_run(wan_t2v_dir, tmp_path):
    checkpoint_dir = tmp_path / "jobs-checkpoints"
    first = Server(wan_t2v_dir, tmp_path, *FLAGS)
    try:
        video = _client(first).videos.create(prompt="a cat", size="32x32", extra_body={"steps": STEPS, "num_frames": 5})
        checkpoint = checkpoint_dir / f"{video.id}.ckpt"
        body = first.wait(video.id, lambda b: checkpoint.exists() or b["status"] in ENDED)
        assert body["status"] not in ENDED, f"the job ended before its first checkpoint could be seen: {body}"
    finally:
        first.kill()
    assert checkpoint.exists() and not [p for p in checkpoint_dir.iterdir() if p != checkpoint]  # no temp file left

    second = Server(wan_t2v_dir, tmp_path, *FLAGS)
    try:
        client = _client(second)
        done, seen = _poll(client, video.id)
        assert done.status == "completed" and seen[-2:] == ["in_progress", "completed"], (seen, done)
        resumed = done.model_extra["resumed_from_step"]
        assert resumed >= EVERY and resumed % EVERY == 0 and resumed < STEPS, resumed
        metrics = done.model_extra["metrics"]
        assert metrics["steps"] == STEPS and done.progress == 100
        assert not checkpoint.exists() and list(checkpoint_dir.iterdir()) == []  # deleted when the job finished

        # the same request, uninterrupted (its seed was fixed when it was first submitted)
        again = client.videos.create(prompt="a cat", size="32x32",
                                     extra_body={"steps": STEPS, "num_frames": 5, "seed": metrics["seed"]})
        reference, _ = _poll(client, again.id)
        assert reference.status == "completed" and reference.model_extra["resumed_from_step"] is None
        resumed_mp4 = client.videos.download_content(video.id).content
        # the same video: equal bytes in every run but one of many full-suite CI runs (2026-12-07, resumed
        # at an unrecorded step); the engine-level claim stays bitwise (tests/engine/test_checkpoints.py:
        # latents torch.equal from every step), here decoded frames within an ulp's re-encode (tests/media.py)
        assert_same_video(resumed_mp4, client.videos.download_content(again.id).content)
        assert httpx.get(f"{second.url}/v1/videos/{video.id}").json()["resumed_from_step"] == resumed
    finally:
        second.stop()
