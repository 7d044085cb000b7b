"""``JobArchive``: a durable ``JobStore``'s other half, the SQLite rows (``job_db.py``) and
the output files (``<output dir>/<job id>.mp4``, ``.png``, ``.thumbnail.png``).

A job's files are written (temporary name, fsync, rename) before its row says
``completed``, so a completed row always has its files; a crash in between leaves an
orphan file that the next start deletes. ``restore`` reads the rows back after a restart:
finished jobs as they were; a job the dead process had ``queued`` or ``in_progress`` is
``failed`` with an error saying so, or queued again (``requeue_on_restart``: it resumes
from its crash checkpoint, ``job_checkpoints.py``, where it has one), at most
``max_job_restarts`` times; never lost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omniloop.models.manifest import atomic_write
from omniloop.request import ErrorKind, Failure, FinalEvent, OmniOutput, OmniRequest, RequestStatus
from omniloop.serve.job_db import JobDatabase, JobStoreError
from omniloop.serve.jobs import Geometry, Job, JobKind

logger = logging.getLogger(__name__)
_SUFFIX = {(JobKind.VIDEO, "content"): ".mp4", (JobKind.VIDEO, "thumbnail"): ".thumbnail.png",
           (JobKind.IMAGE, "content"): ".png"}


class JobArchive:
    def __init__(self, db_path: str | Path, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir).expanduser()
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise JobStoreError(f"output dir {self.output_dir}: is a file; pass a directory for the job outputs")
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JobStoreError(f"output dir {self.output_dir}: cannot be created ({e.strerror}); pass another "
                                "--output-dir") from None
        self.db = JobDatabase(db_path)

    # -- writes (the event loop's thread, except ``write``) ------------------------------
    def insert(self, job: Job, request: OmniRequest | None) -> None:
        self.db.insert({**self._fields(job), "id": job.id, "kind": job.kind.value, "model": job.model,
                        "prompt": job.prompt, "geometry": job.geometry.__dict__, "created_at": job.created_at,
                        "request": request.model_dump_json() if request is not None else None})

    def update(self, job: Job) -> None:
        self.db.update(job.id, self._fields(job))

    def _fields(self, job: Job) -> dict[str, Any]:
        fields: dict[str, Any] = {"status": job.status.value, "progress": job.progress,
                                  "completed_at": job.completed_at, "error": job.error, "metrics": job.metrics,
                                  "restarts": job.restarts, "resumed_from": job.resumed_from_step}
        if job.sealed:
            fields["events"] = job.events
            fields["outputs"] = {name: p.name for name, p in job.outputs.items() if isinstance(p, Path)}
        return fields

    def write(self, job: Job, outputs: dict[str, bytes]) -> dict[str, Path]:
        """Each output to its file, durably (runs in a worker thread)."""
        paths = {}
        for name, data in outputs.items():
            path = self.output_dir / f"{job.id}{_SUFFIX[job.kind, name]}"
            atomic_write(path, data)
            paths[name] = path
        return paths

    def delete(self, job: Job) -> None:
        self.db.delete(job.id)
        for path in job.outputs.values():
            if isinstance(path, Path):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()

    # -- a restart --------------------------------------------------------------------------
    def restore(self, *, max_restarts: int | None) -> tuple[list[Job], list[tuple[Job, OmniRequest]]]:
        """(every stored job, oldest first; the unfinished ones to submit again). ``max_restarts``:
        how often one job may run again (None: never, ``requeue_on_restart`` is off); a job the
        server died under more often than that is failed, so it cannot crash it forever."""
        try:
            rows = self.db.rows()
        except (ValueError, TypeError) as e:
            raise JobStoreError(f"job store {self.db.path}: a row cannot be read ({e}); move it away or pass "
                                "another --job-store path") from None
        jobs, pending = [], []
        requeue = max_restarts is not None
        for row in rows:
            job = self._job(row)
            if not job.sealed:
                request = _request(row["request"]) if requeue else None
                if request is not None and max_restarts is not None and job.restarts >= max_restarts:
                    self._interrupted(job, requeue, f"; it ran again {job.restarts} time(s) after the server "
                                      f"died and is not run again (--max-job-restarts {max_restarts}): submit it again")
                elif request is not None:
                    job.restarts += 1
                    self.update(job)
                    pending.append((job, request))
                elif requeue:  # a row of another omniloop version, or of a store without requests
                    self._interrupted(job, requeue, "; its stored request cannot be read by this version of omniloop, "
                                      "so it cannot run again: submit it again")
                else:
                    self._interrupted(job, requeue)
            jobs.append(job)
        self._delete_orphans({p for job in jobs for p in job.outputs.values()})
        logger.info("job store %s: %d job(s) restored, %d re-queued", self.db.path, len(jobs), len(pending))
        return jobs, pending

    def _job(self, row: dict[str, Any]) -> Job:
        status = RequestStatus(row["status"])
        outputs = {name: self.output_dir / file for name, file in (row["outputs"] or {}).items()}
        job = Job(id=row["id"], kind=JobKind(row["kind"]), model=row["model"], prompt=row["prompt"],
                  geometry=Geometry(**row["geometry"]), created_at=row["created_at"], status=status,
                  progress=row["progress"] or 0, completed_at=row["completed_at"],
                  failure=None if row["error"] is None else Failure(kind=ErrorKind.UNKNOWN, message=row["error"]),
                  outputs=outputs, metrics=row["metrics"], events=list(row["events"] or []),
                  restarts=row["restarts"] or 0, resumed_from_step=row["resumed_from"])
        job.output_bytes = sum(p.stat().st_size for p in outputs.values() if p.is_file())
        if status.finished:
            job.sealed = True
            missing = [str(p) for p in outputs.values() if not p.is_file()]
            if missing:  # removed behind our back: say so rather than fail a download later
                job.status, job.outputs = RequestStatus.FAILED, {}
                job.failure = Failure(kind=ErrorKind.INTERRUPTED, message=f"its output file {missing[0]} is missing "
                                      "(removed while the server was down)")
                self.update(job)
        return job

    def _interrupted(self, job: Job, requeue: bool, why: str | None = None) -> None:
        was = job.status.value  # queued / in_progress
        job.status, job.completed_at = RequestStatus.FAILED, int(time.time())
        message = f"the server stopped while this job was {was}; it did not finish" + (why or (
            ": submit it again" + ("" if requeue else " (omniloop serve without --no-requeue-on-restart queues such jobs again)")))
        job.failure = Failure(kind=ErrorKind.INTERRUPTED, message=message)
        job.publish(FinalEvent(request_id=job.id, output=OmniOutput(request_id=job.id, status=job.status,
                                                                    failure=job.failure)).to_dict())
        job.sealed = True
        self.update(job)

    def _delete_orphans(self, kept: set[Any]) -> None:
        for path in self.output_dir.iterdir():
            if path.is_file() and path not in kept:
                logger.info("deleting %s: no job refers to it (a write cut short by a crash)", path)
                path.unlink(missing_ok=True)


def _request(raw: str | None) -> OmniRequest | None:
    if raw is None:
        return None
    try:
        return OmniRequest.model_validate_json(raw)
    except ValidationError:
        return None  # written by another version: reported failed instead
