"""The job store: one ``Job`` per engine request the server accepted (a video, or one
image of an images call), bounded, with an event history any number of followers replay.

A job is one object with an enum status (the engine's ``RequestStatus``); its content
(mp4 or png bytes) is set before the job reaches ``completed``, so a client that sees
``completed`` can always download.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from omniloop.request import OmniRequest, RequestStatus


class JobKind(str, Enum):
    VIDEO = "video"
    IMAGE = "image"


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
    def of(cls, request: OmniRequest, defaults: Mapping[str, Any], seconds: float | None = None) -> "Geometry":
        """``request``'s geometry with the model's ``defaults`` for what it leaves unset."""
        p, d = request.diffusion, defaults
        frames = p.num_frames or (1 if request.task.makes_image else d.get("num_frames", 1))
        fps = p.fps or d.get("fps", 16)
        return cls(width=p.width or d.get("width", 0), height=p.height or d.get("height", 0), num_frames=frames,
                   fps=fps, steps=p.num_steps(d.get("steps", 0)),
                   seconds=f"{seconds:g}" if seconds is not None else f"{frames / fps:g}")


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
    error: str | None = None
    content: bytes | None = None  # mp4 (video) or png (image)
    thumbnail: bytes | None = None  # png of a video's first frame
    metrics: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # OmniEvent.to_dict() history
    loop_nodes: set[str] = field(default_factory=set)  # nodes that reported step progress
    sealed: bool = False  # no more events will come
    _tick: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self.status.finished

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

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, f"capacity must be >= 1, got {capacity}"
        self.capacity = capacity
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def room_for(self, count: int) -> bool:
        finished = sum(1 for j in self._jobs.values() if j.sealed)
        return len(self._jobs) - finished + count <= self.capacity

    def add(self, job: Job) -> None:
        """Store ``job``, evicting the oldest finished jobs beyond capacity. Callers check
        ``room_for`` first; concurrent submissions may overshoot by the jobs in flight."""
        assert job.id not in self._jobs, f"job id {job.id} reused"
        while len(self._jobs) >= self.capacity:
            oldest = next((j for j in self._jobs.values() if j.sealed), None)
            if oldest is None:
                break
            del self._jobs[oldest.id]
        self._jobs[job.id] = job

    def remove(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

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
