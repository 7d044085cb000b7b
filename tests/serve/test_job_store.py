"""Durable jobs without a process restart: the SQLite store and output files round-trip a
job's record, an unusable store is a startup error naming its path (before the model
loads), retention drops the oldest finished jobs with their files. (A real ``omniloop serve``
killed mid-job and restarted: test_durable_restart.py.)"""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest

from omniloop.api.cli import main
from omniloop.request import DiffusionParams, OmniRequest, RequestStatus, TaskType, TextPart
from omniloop.serve.config import ServeConfig
from omniloop.serve.job_db import JobStoreError
from omniloop.serve.jobs import Geometry, Job, JobKind, JobStore, read_output
from tests.serve.conftest import live_server

GEOMETRY = Geometry(width=32, height=32, num_frames=5, fps=8, steps=2, seconds="0.625")


def _job(job_id: str) -> tuple[Job, OmniRequest]:
    request = OmniRequest(request_id=job_id, task=TaskType.T2V, inputs=[TextPart(text="a cat")],
                          diffusion=DiffusionParams(steps=2, height=32, width=32, num_frames=5))
    return Job(id=job_id, kind=JobKind.VIDEO, model="wan", prompt="a cat", geometry=GEOMETRY), request


def _finish(store: JobStore, job: Job, outputs: dict[str, bytes]) -> None:
    store.keep(job, outputs)
    job.status, job.progress, job.completed_at = RequestStatus.COMPLETED, 100, int(time.time())
    job.publish({"type": "final", "request_id": job.id})
    job.seal()
    store.save(job)


def test_records_and_files_survive_a_reopen(tmp_path):
    config = ServeConfig(job_store=tmp_path / "jobs.db", requeue_on_restart=False)
    store = JobStore.open(config)
    done, running, queued = (_job(i) for i in ("video_done", "video_running", "video_queued"))
    for job, request in (done, running, queued):
        store.add(job, request)
    running[0].status = RequestStatus.RUNNING
    store.save(running[0])
    _finish(store, done[0], {"content": b"mp4 bytes", "thumbnail": b"png bytes"})
    assert done[0].outputs["content"] == tmp_path / "jobs-outputs" / "video_done.mp4"
    (tmp_path / "jobs-outputs" / "video_x.mp4").write_bytes(b"a write a crash cut short")
    store.close()

    again = JobStore.open(config)
    done2, running2, queued2 = (again.get(i) for i in ("video_done", "video_running", "video_queued"))
    assert done2.status is RequestStatus.COMPLETED and done2.has_content and done2.events[-1]["type"] == "final"
    assert read_output(done2, "content") == b"mp4 bytes" and read_output(done2, "thumbnail") == b"png bytes"
    assert (done2.geometry, done2.prompt, done2.progress) == (GEOMETRY, "a cat", 100)
    for job, was in ((running2, "in_progress"), (queued2, "queued")):
        assert job.status is RequestStatus.FAILED and job.sealed and job.completed_at is not None
        assert job.error.startswith(f"the server stopped while this job was {was}; it did not finish: submit it "
                                    "again (omniloop serve without --no-requeue-on-restart")
        assert job.events[-1]["type"] == "final" and job.events[-1]["output"]["status"] == "failed"
    assert not (tmp_path / "jobs-outputs" / "video_x.mp4").exists()  # the orphan is gone
    assert [j.id for j in again.page(JobKind.VIDEO, after=None, limit=10, order="asc")[0]] == [
        "video_done", "video_running", "video_queued"]  # creation order kept
    again.close()


def test_requeue_on_restart_hands_back_the_requests(tmp_path):
    config = ServeConfig(job_store=tmp_path / "jobs.db", requeue_on_restart=False)
    store = JobStore.open(config)
    job, request = _job("video_1")
    store.add(job, request)
    store.close()
    again = JobStore.open(config.model_copy(update={"requeue_on_restart": True}))
    ((pending, again_request),) = again.pending
    assert pending.id == "video_1" and not pending.sealed and again_request == request
    again.close()


def test_a_deleted_output_file_is_reported_not_served(tmp_path):
    config = ServeConfig(job_store=tmp_path / "jobs.db", output_dir=tmp_path / "out")
    store = JobStore.open(config)
    job, request = _job("video_1")
    store.add(job, request)
    _finish(store, job, {"content": b"mp4", "thumbnail": b"png"})
    store.close()
    (tmp_path / "out" / "video_1.mp4").unlink()
    again = JobStore.open(config)
    job = again.get("video_1")
    assert job.status is RequestStatus.FAILED and not job.has_content
    assert job.error == f"its output file {tmp_path / 'out' / 'video_1.mp4'} is missing (removed while the server " \
                        "was down)"
    again.close()


def test_an_unusable_store_is_a_startup_error_naming_the_path(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JobStoreError, match=rf"^job store {garbage}: not a readable SQLite database \(file is not a "
                                            r"database\); move it away or pass another --job-store path$"):
        JobStore.open(ServeConfig(job_store=garbage))
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE users (name TEXT)").connection.close()
    with pytest.raises(JobStoreError, match=r"is a SQLite database, but not an omniloop job store \(tables \['users'\]"):
        JobStore.open(ServeConfig(job_store=other))
    with pytest.raises(JobStoreError, match="is a directory, not a SQLite file"):
        JobStore.open(ServeConfig(job_store=tmp_path))
    with pytest.raises(ValueError, match="output_dir needs job_store"):
        ServeConfig(output_dir=tmp_path / "out")


def test_serve_refuses_a_corrupt_store_before_loading_the_model(tmp_path, capsys):
    garbage = tmp_path / "jobs.db"
    garbage.write_bytes(b"\x00garbage" * 512)
    # the model does not exist: the job store's error must come first
    code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--job-store", str(garbage)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (f"error: job store {garbage}: not a readable SQLite database (file is not a "
                                         "database); move it away or pass another --job-store path")


def test_retention_drops_the_oldest_completed_jobs_with_their_files(wan_t2v_dir, tmp_path):
    body = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 1}
    serve = {"job_store": tmp_path / "jobs.db", "retention_max_bytes": 1}  # keeps only the newest
    with live_server(wan_t2v_dir, serve=serve) as live:
        ids = []
        for seed in range(3):
            ids.append(httpx.post(f"{live.url}/v1/videos", json={**body, "seed": seed}).json()["id"])
            assert live.wait_finished(ids[-1])["status"] == "completed"
        files = sorted(p.name for p in (tmp_path / "jobs-outputs").iterdir())
        assert files == [f"{ids[2]}.mp4", f"{ids[2]}.thumbnail.png"]
        assert [httpx.get(f"{live.url}/v1/videos/{i}").status_code for i in ids] == [404, 404, 200]
        assert httpx.get(f"{live.url}/v1/videos/{ids[2]}/content").headers["content-type"] == "video/mp4"


def test_age_retention_and_expires_at(wan_t2v_dir, tmp_path):
    serve = {"job_store": tmp_path / "jobs.db", "retention_max_age_s": 1.0}
    with live_server(wan_t2v_dir, serve=serve) as live:
        video_id = httpx.post(f"{live.url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5,
                                                            "steps": 1}).json()["id"]
        done = live.wait_finished(video_id)
        assert done["expires_at"] == done["completed_at"] + 1
        deadline = time.monotonic() + 30
        while httpx.get(f"{live.url}/v1/videos/{video_id}").status_code != 404:  # swept 4 times a max age
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert list((tmp_path / "jobs-outputs").iterdir()) == []
