"""The job store: one ``Job`` per engine request the server accepted (a video, or one
image of an images call), bounded, with an event history any number of followers replay.

A job is one object with an enum status (the engine's ``RequestStatus``); its outputs
(mp4 or png, and a video's thumbnail) are kept before the job reaches ``completed``, so a
client that sees ``completed`` can always download. In memory by default; with a
``JobArchive`` (``--job-store``) every record is also in SQLite and the outputs are files,
so both survive a restart. Retention (``--retention-max-bytes`` / ``--retention-max-age-s``)
drops the oldest finished jobs first, with their files.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import logging

from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.request import Failure, OmniRequest, RequestStatus

if TYPE_CHECKING:
    from omniloop.serve.job_archive import JobArchive
    from omniloop.serve.job_checkpoints import JobCheckpoints


logger = logging.getLogger(__name__)


class JobKind(str, Enum):
    VIDEO = "video"
    IMAGE = "image"
    AUDIO = "audio"


@dataclass(frozen=True)
class Geometry:
    """What a job will produce, with the model's defaults resolved."""

    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    seconds: str

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @classmethod
    def of(cls, request: OmniRequest, defaults: GenerationDefaults, seconds: float | None = None) -> "Geometry":
        """``request``'s geometry with the model's ``defaults`` for what it leaves unset."""
        p, d = request.diffusion, defaults
        frames = p.num_frames or (1 if request.task.makes_image else d.num_frames or 1)
        fps = p.fps or d.fps or 16
        return cls(width=p.width or d.width or 0, height=p.height or d.height or 0, num_frames=frames,
                   fps=fps, steps=p.num_steps(d.steps),
                   seconds=f"{seconds:g}" if seconds is not None else f"{frames / fps:g}")

    def admitted(self, request: OmniRequest, steps: int | None) -> "Geometry":
        """These values as the engine's admission resolved them (``request``: the resolved
        request; ``steps``: what its first denoise loop runs, its node_params' included):
        what the job reports is what runs. A value the request does not carry (an audio job's
        size) stays; the seconds stay as asked unless the frames or fps changed."""
        p = request.diffusion
        width, height = p.width or self.width, p.height or self.height
        frames, fps = p.num_frames or self.num_frames, p.fps or self.fps
        seconds = self.seconds if (frames, fps) == (self.num_frames, self.fps) else f"{frames / fps:g}"
        return Geometry(width=width, height=height, num_frames=frames, fps=fps,
                        steps=self.steps if steps is None else steps, seconds=seconds)


@dataclass(eq=False)
class Job:
    id: str
    kind: JobKind
    model: str
    prompt: str
    geometry: Geometry
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: RequestStatus = RequestStatus.QUEUED
    progress: int = 0  # percent; 100 only once completed
    completed_at: int | None = None
    failure: Failure | None = None  # why it ended without its result
    # "content" (mp4 of a video, png of an image, the audio file of an audio job) and "thumbnail" (png of a video's first
    # frame): bytes in memory, or the file holding them (a durable store)
    outputs: Mapping[str, bytes | Path] = field(default_factory=dict)
    output_bytes: int = 0
    audio_format: str = "wav"  # an audio job's file format (wav, flac, mp3)
    metrics: dict[str, Any] | None = None
    weight_version: str | None = None  # the engine's weights it ran on (POST /v1/weights; None: not run yet)
    actions: list[list[float]] | None = None  # predicted actions of a world-model job
    events: list[dict[str, Any]] = field(default_factory=list)  # OmniEvent.to_dict() history
    loop_nodes: set[str] = field(default_factory=set)  # nodes that reported step progress
    restarts: int = 0  # times it ran again after the server died (a durable store's --requeue-on-restart)
    resumed_from_step: int | None = None  # the step its loop resumed from after a crash (a checkpoint)
    sealed: bool = False  # no more events will come
    _tick: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def error(self) -> str | None:
        return None if self.failure is None else self.failure.message

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def has_content(self) -> bool:
        return self.sealed and "content" in self.outputs

    def publish(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._wake()

    def seal(self) -> None:
        self.sealed = True
        self._wake()

    def _wake(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    async def follow(self, heartbeat_s: float | None = None) -> AsyncIterator[dict[str, Any] | None]:
        """Every event from the first, then live ones, until the job is sealed; ``None``
        after each ``heartbeat_s`` without an event (for keepalives)."""
        i = 0
        while True:
            tick = self._tick  # taken before reading, so a publish in between is not missed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.sealed:
                return
            try:
                await asyncio.wait_for(tick.wait(), heartbeat_s)
            except asyncio.TimeoutError:
                yield None

    async def wait_sealed(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._until_sealed(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _until_sealed(self) -> None:
        while not self.sealed:
            await self._tick.wait()


class JobStore:
    """Jobs by id in creation order. At capacity the oldest finished job is evicted; if
    every stored job is still running, ``add`` refuses (the caller answers 429)."""

    def __init__(self, capacity: int, *, archive: JobArchive | None = None, max_bytes: int | None = None,
                 max_age_s: float | None = None) -> None:
        assert capacity >= 1, f"capacity must be >= 1, got {capacity}"
        self.capacity, self.archive, self.max_bytes, self.max_age_s = capacity, archive, max_bytes, max_age_s
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self.pending: list[tuple[Job, OmniRequest]] = []  # restored unfinished jobs to re-queue
        self.checkpoints: JobCheckpoints | None = None  # running jobs' crash checkpoints (requeue_on_restart)

    @classmethod
    def open(cls, config: Any) -> "JobStore":
        """The store a ``ServeConfig`` asks for: durable with ``job_store`` (its records
        restored: unfinished ones failed, or re-queued with ``requeue_on_restart``, to resume
        from their crash checkpoints where they have one)."""
        archive = None
        if config.job_store is not None:
            from omniloop.serve.job_archive import JobArchive

            archive = JobArchive(config.job_store, config.outputs_dir())
        store = cls(config.max_jobs, archive=archive, max_bytes=config.retention_max_bytes,
                    max_age_s=config.retention_max_age_s)
        if archive is not None:
            restarts = config.max_job_restarts if config.requeue_on_restart else None
            jobs, store.pending = archive.restore(max_restarts=restarts)
            for job in jobs:
                store._jobs[job.id] = job
            store.sweep()
        if archive is not None and config.requeue_on_restart:
            from omniloop.serve.job_checkpoints import JobCheckpoints

            store.checkpoints = JobCheckpoints(config.checkpoints_dir(), config.checkpoint_cadence(),
                                               config.checkpoint_max_bytes)
            found = store.checkpoints.adopt({job.id for job, _ in store.pending})
            if store.pending:
                logger.info("%d re-queued job(s), %d of them resuming from a checkpoint", len(store.pending),
                            len(found))
        return store

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def room_for(self, count: int) -> bool:
        finished = sum(1 for j in self._jobs.values() if j.sealed)
        return len(self._jobs) - finished + count <= self.capacity

    def add(self, job: Job, request: OmniRequest | None = None) -> None:
        """Store ``job`` (and the ``request`` it runs, to re-queue it after a restart),
        evicting the oldest finished jobs beyond capacity. Callers check ``room_for``
        first; concurrent submissions may overshoot by the jobs in flight."""
        assert job.id not in self._jobs, f"job id {job.id} reused"
        while len(self._jobs) >= self.capacity:
            oldest = next((j for j in self._jobs.values() if j.sealed), None)
            if oldest is None:
                break
            self.remove(oldest.id)
        self._jobs[job.id] = job
        if self.archive is not None:
            self.archive.insert(job, request)

    def save(self, job: Job) -> None:
        """Record ``job``'s status (its events and outputs too, once it is sealed)."""
        if self.archive is not None and job.id in self._jobs:
            self.archive.update(job)

    def keep(self, job: Job, outputs: dict[str, bytes]) -> None:
        """Hold a finished job's encoded outputs: as bytes, or written to files (durable).
        Runs in a worker thread: it touches only the files and ``job.outputs``."""
        job.outputs = self.archive.write(job, outputs) if self.archive is not None else dict(outputs)
        job.output_bytes = sum(len(b) for b in outputs.values())

    def remove(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None and self.archive is not None:
            self.archive.delete(job)

    def sweep(self, now: float | None = None) -> list[str]:
        """Retention: drop finished jobs older than ``max_age_s``, then the oldest completed
        ones while their outputs exceed ``max_bytes`` (never the newest: what a client just
        made stays downloadable); returns the ids removed."""
        now = time.time() if now is None else now
        done = sorted((j for j in self._jobs.values() if j.sealed), key=lambda j: j.completed_at or j.created_at)
        age = self.max_age_s
        gone = [j for j in done if age is not None and now - (j.completed_at or j.created_at) > age]
        kept = [j for j in done if j not in gone]
        total = sum(j.output_bytes for j in kept)
        for job in kept[:-1]:
            if self.max_bytes is None or total <= self.max_bytes:
                break
            if job.output_bytes:
                gone.append(job)
                total -= job.output_bytes
        for job in gone:
            self.remove(job.id)
        return [j.id for j in gone]

    def expires_at(self, job: Job) -> int | None:
        if self.max_age_s is None or job.completed_at is None:
            return None
        return int(job.completed_at + self.max_age_s)

    def page(self, kind: JobKind, *, after: str | None, limit: int,
             order: Literal["asc", "desc"]) -> tuple[list[Job], bool]:
        """A page of ``kind`` jobs after the job ``after`` (exclusive); (jobs, has_more)."""
        jobs = [j for j in self._jobs.values() if j.kind is kind]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def unfinished(self) -> list[Job]:
        return [j for j in self._jobs.values() if not j.sealed]

    def close(self) -> None:
        if self.archive is not None:
            self.archive.close()


def read_output(job: Job, name: str) -> bytes:
    """An output's bytes, from memory or from its file."""
    value = job.outputs[name]
    return value.read_bytes() if isinstance(value, Path) else value


def output_response(job: Job, name: str, media_type: str, filename: str | None = None) -> Any:
    """An HTTP response of an output: from memory, or streamed from its file."""
    from starlette.responses import FileResponse, Response

    value = job.outputs[name]
    headers = {"Content-Disposition": f'attachment; filename="{filename}"'} if filename else None
    if isinstance(value, Path):
        return FileResponse(value, media_type=media_type, headers=headers)
    return Response(value, media_type=media_type, headers=headers)
