"""The crash checkpoints of a durable job store (serve/job_checkpoints.py) without killing a
process: the file format refuses damaged files saying what is wrong, a restart adopts the
checkpoints of the jobs it re-queues and deletes the rest, the disk budget holds, a job the
server died under too often is failed instead of run again (no crash loop), a version 1
store is migrated in place, and on a live server a re-queued job whose checkpoint is corrupt
runs from its first step while one whose model is no longer served fails naming it. (A real
server killed with SIGKILL mid-job and resumed: test_resume_restart.py.)"""

from __future__ import annotations

import re
import sqlite3

import pytest
import torch

from omniloop.engine.checkpoints import CheckpointCadence
from omniloop.pipeline.checkpoint import LoopCheckpoint
from omniloop.request import DiffusionParams, OmniRequest, RequestStatus, TaskType, TextPart
from omniloop.serve.config import ServeConfig
from omniloop.serve.job_checkpoints import (
    CheckpointCorrupt, JobCheckpoints, decode_checkpoint, encode_checkpoint, read_header,
)
from omniloop.serve.jobs import Geometry, Job, JobKind, JobStore
from tests.serve.conftest import live_server

GEOMETRY = Geometry(width=32, height=32, num_frames=5, fps=8, steps=3, seconds="0.625")


def _checkpoint(step: int = 2, node: str = "denoise") -> LoopCheckpoint:
    gen = torch.Generator().manual_seed(5)
    return LoopCheckpoint(node=node, steps_done=step, steps_target=6,
                          tensors={"latents/video": torch.randn(1, 4, 2, 4, 4, generator=gen) * step,
                                   "sampler/video/gen": gen.get_state()},
                          values={"sampler/video/step_index": step, "sampler/video/gen#generator": "cpu", "x": None})


def _job(job_id: str, model: str = "wan") -> tuple[Job, OmniRequest]:
    request = OmniRequest(request_id=job_id, task=TaskType.T2V, inputs=[TextPart(text="a cat")],
                          diffusion=DiffusionParams(steps=3, height=32, width=32, num_frames=5, seed=1))
    return Job(id=job_id, kind=JobKind.VIDEO, model=model, prompt="a cat", geometry=GEOMETRY), request


def test_the_file_round_trips_and_damage_is_named():
    ck = _checkpoint()
    data = encode_checkpoint(ck)
    back = decode_checkpoint(data)
    assert (back.node, back.steps_done, back.values) == (ck.node, ck.steps_done, ck.values)
    assert all(torch.equal(back.tensors[k], v) for k, v in ck.tensors.items())
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    for damaged, why in ((bytes(flipped), "its checksum does not match (the file was damaged)"),
                         (data[:-100], "truncated: "), (b"PK\x03\x04" + data, "not an omniloop checkpoint (bad magic)")):
        with pytest.raises(CheckpointCorrupt, match=f"^{re.escape(why)}"):
            decode_checkpoint(damaged)


def test_a_restart_adopts_the_requeued_jobs_checkpoints_and_deletes_the_rest(tmp_path):
    config = ServeConfig(job_store=tmp_path / "jobs.db", requeue_on_restart=True, checkpoint_max_bytes=10**6)
    store = JobStore.open(config)
    assert store.checkpoints is not None and store.checkpoints.directory == tmp_path / "jobs-checkpoints"
    for job, request in (_job("video_a"), _job("video_b")):
        store.add(job, request)
    store.checkpoints.save("video_a", _checkpoint(4))
    store.checkpoints.save("video_gone", _checkpoint(1))  # a job the store no longer has
    (store.checkpoints.directory / ".video_a.ckpt.tmp").write_bytes(b"a write a crash cut short")
    store.close()

    again = JobStore.open(config)
    assert sorted(j.id for j, _ in again.pending) == ["video_a", "video_b"]
    files = sorted(p.name for p in again.checkpoints.directory.iterdir())
    assert files == ["video_a.ckpt"]
    reports = []
    again.checkpoints.on_resumed = lambda *a: reports.append(a)
    assert again.checkpoints.resume_point("video_a", "refine") is None  # another loop's: kept for it
    ck = again.checkpoints.resume_point("video_a", "denoise")
    assert ck is not None and ck.steps_done == 4 and torch.equal(ck.tensors["latents/video"],
                                                                 _checkpoint(4).tensors["latents/video"])
    assert again.checkpoints.resume_point("video_a", "denoise") is None  # once
    assert again.checkpoints.resume_point("video_b", "denoise") is None and reports == []
    again.checkpoints.discard("video_a")
    assert list(again.checkpoints.directory.iterdir()) == []
    again.close()


def test_a_corrupt_checkpoint_is_reported_and_the_budget_holds(tmp_path):
    one = len(encode_checkpoint(_checkpoint()))
    store = JobCheckpoints(tmp_path / "ck", CheckpointCadence(), max_bytes=one + one // 2)
    store.save("video_a", _checkpoint(1))
    store.save("video_b", _checkpoint(1))  # beyond the budget: not written
    store.save("video_a", _checkpoint(3))  # replaces its own: fits
    assert sorted(p.name for p in store.directory.iterdir()) == ["video_a.ckpt"] and store.total_bytes == one
    path = store.path("video_a")
    payload = read_header(path.read_bytes())[0]["payload_bytes"]
    path.write_bytes(path.read_bytes()[:-7])
    again = JobCheckpoints(tmp_path / "ck", CheckpointCadence(), max_bytes=10**6)
    assert again.adopt({"video_a"}) == {"video_a"}
    reports = []
    again.on_resumed = lambda *a: reports.append(a)
    assert again.resume_point("video_a", "denoise") is None
    ((job_id, node, step, why),) = reports
    assert (job_id, node, step) == ("video_a", "denoise", None)
    assert why == f"its checkpoint {path} cannot be used: truncated: {payload - 7} of {payload} payload bytes"


def test_a_job_the_server_died_under_too_often_is_failed_not_run_again(tmp_path):
    config = ServeConfig(job_store=tmp_path / "jobs.db", requeue_on_restart=True, max_job_restarts=2)
    store = JobStore.open(config)
    store.add(*_job("video_a"))
    store.close()
    for restarts in (1, 2):
        store = JobStore.open(config)
        ((job, _),) = store.pending
        assert job.restarts == restarts and not job.sealed
        store.close()
    store = JobStore.open(config)
    job = store.get("video_a")
    assert store.pending == [] and job.status is RequestStatus.FAILED and job.sealed
    assert job.error == ("the server stopped while this job was queued; it did not finish; it ran again 2 time(s) "
                         "after the server died and is not run again (--max-job-restarts 2): submit it again")
    store.add(*_job("video_b"))
    store.close()
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.execute("UPDATE jobs SET request = ? WHERE id = 'video_b'", ('{"task": "no-such-task"}',))
    db.commit()
    db.close()
    store = JobStore.open(config)
    assert store.pending == [] and store.get("video_b").error == (
        "the server stopped while this job was queued; it did not finish; its stored request cannot be read by this "
        "version of omniloop, so it cannot run again: submit it again")
    store.close()


def test_a_version_1_store_is_migrated_in_place(tmp_path):
    path = tmp_path / "jobs.db"
    db = sqlite3.connect(path)
    columns = ("kind", "model", "prompt", "geometry", "created_at", "status", "progress", "completed_at", "error",
               "metrics", "request", "events", "outputs")
    db.executescript(f"""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, {", ".join(f"{c} TEXT" for c in columns)});
        INSERT INTO meta VALUES ('app', 'omniloop-jobs'), ('schema_version', '1');""")
    db.close()
    store = JobStore.open(ServeConfig(job_store=path, requeue_on_restart=True))
    store.add(*_job("video_a"))
    store.close()
    again = JobStore.open(ServeConfig(job_store=path, requeue_on_restart=True))
    assert [j.id for j, _ in again.pending] == ["video_a"] and again.get("video_a").restarts == 1
    again.close()
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)


def test_on_a_live_server_a_corrupt_checkpoint_runs_from_step_0_and_an_unserved_model_fails(wan_t2v_dir, tmp_path):
    serve = {"job_store": tmp_path / "jobs.db", "requeue_on_restart": True}
    store = JobStore.open(ServeConfig(**serve))
    damaged, _ = pair = _job("video_damaged", model=wan_t2v_dir.name)
    damaged.status = RequestStatus.RUNNING
    store.add(*pair)
    store.save(damaged)
    store.add(*_job("video_other_model", model="wan-14b"))
    store.checkpoints.path("video_damaged").write_bytes(b"OMNILOOP-CKPT-1\n\x00\x00")
    store.close()
    with live_server(wan_t2v_dir, serve=serve) as server:
        body = server.wait_finished("video_damaged")
        assert body["status"] == "completed" and body["resumed_from_step"] is None and body["metrics"]["steps"] == 3
        other = server.wait_finished("video_other_model")
        assert other["status"] == "failed" and other["error"]["message"] == (
            f"re-queued after a restart, then refused: it ran on model 'wan-14b', which this server does not serve "
            f"now (it serves ['{wan_t2v_dir.name}']); submit it again")
        assert list((tmp_path / "jobs-checkpoints").iterdir()) == []
