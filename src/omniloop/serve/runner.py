"""``JobRunner``: drives accepted jobs through the AsyncEngine.

``start`` submits (the engine's rejection propagates, nothing is stored), then one task
per job follows the engine's events into the job: status, progress, event history, and
at the end the encoded content (mp4/png, off the event loop), metrics and the final event.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from omniloop.engine import AsyncEngine, UnknownRequest
from omniloop.io import encode_audio, encode_mp4, write_png
from omniloop.request import (
    ErrorKind, Failure, FinalEvent, OmniEvent, OmniOutput, OmniRequest, ProgressEvent, RequestStatus, StatusEvent,
)
from omniloop.serve.chunks import ChunkSegments, is_video_chunk
from omniloop.serve.jobs import Job, JobKind, JobStore
from omniloop.serve.metrics import ServeMetrics

logger = logging.getLogger(__name__)


def _png(image) -> bytes:
    buf = io.BytesIO()
    write_png(image, buf)
    return buf.getvalue()


def encode_outputs(kind: JobKind, output: OmniOutput, audio_format: str = "wav", prompt: str | None = None
                   ) -> dict[str, bytes]:
    """A video job's mp4 ("content"; with an AAC track when the output has sound, ``prompt`` as its
    title as ``omniloop generate`` writes it) and a png of its first frame ("thumbnail"); an image
    job's png; an audio job's file ("content")."""
    if kind is JobKind.VIDEO:
        video, sound = output.video, output.audio
        assert video is not None, f"completed video job {output.request_id} has no video artifact"
        audio = dict(audio=sound.samples, sample_rate=sound.sample_rate) if sound is not None else {}
        return {"content": encode_mp4(video.frames, video.fps, title=prompt, **audio), "thumbnail": _png(video.frames[0])}
    if kind is JobKind.AUDIO:
        sound = output.audio
        assert sound is not None, f"completed audio job {output.request_id} has no audio artifact"
        return {"content": encode_audio(sound.samples, sound.sample_rate, audio_format)}
    image = output.image
    assert image is not None, f"completed image job {output.request_id} has no image artifact"
    return {"content": _png(image.image)}


class JobRunner:
    def __init__(self, engine: AsyncEngine, jobs: JobStore, metrics: ServeMetrics) -> None:
        self.engine, self.jobs, self.metrics = engine, jobs, metrics
        self.chunks = ChunkSegments()  # fMP4 segments of causal video jobs' streamed chunks
        self._tasks: set[asyncio.Task] = set()

    async def start(self, job: Job, request: OmniRequest, *, stored: bool = False) -> None:
        """Submit ``request`` as ``job`` (``stored``: a job the store already holds, re-queued
        after a restart). Raises RequestRejected / QueueFull / EngineDeadError."""
        assert request.request_id == job.id, "a job's id is its engine request id"
        stream = self.engine.stream(request)
        first = await anext(stream)  # the submit happens here: a rejection raises
        if not stored:
            self.jobs.add(job, request)
        self._apply(job, first)
        task = asyncio.create_task(self._follow(job, stream), name=f"job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def request_cancel(self, job: Job) -> None:
        """Ask the engine to abort ``job`` at its next step boundary; returns at once."""
        try:
            await self.engine.abort(job.id)
        except UnknownRequest:
            pass  # finished in the meantime

    async def cancel_or_delete(self, job: Job) -> tuple[bool, str]:
        """``DELETE`` on a job: a running one is cancelled at its next step boundary (which may
        be seconds away) and kept, so its final status and partial progress stay visible, and
        the answer does not wait for it ("cancelling", then GET shows "cancelled"); a stopped
        one is removed. Returns (deleted, status)."""
        if not job.sealed:
            await self.request_cancel(job)
            return False, "cancelling" if not job.sealed else job.status.value
        self.jobs.remove(job.id)
        return True, job.status.value

    async def cancel(self, job: Job, wait_s: float) -> bool:
        """Abort at the next step boundary; True once the job has stopped."""
        await self.request_cancel(job)
        return await job.wait_sealed(wait_s)

    async def wait_idle(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.wait_idle()

    # -- following one job ------------------------------------------------------------------
    async def _follow(self, job: Job, stream: AsyncIterator[OmniEvent]) -> None:
        try:
            async for event in stream:
                if isinstance(event, FinalEvent):
                    await self._finish(job, event)
                elif is_video_chunk(event):  # a causal model's chunk: its fMP4 segment, at once
                    job.publish(await asyncio.to_thread(self.chunks.event, job.id, event))
                else:
                    self._apply(job, event)
        except Exception:  # a bug here must not take the server down
            logger.exception("following job %s failed", job.id)
            job.status = RequestStatus.FAILED
            job.failure = Failure(kind=ErrorKind.STAGE_ERROR, message="internal error while following the job")
        finally:
            self.chunks.close(job.id)
            if not job.sealed:  # server shutdown cancelled us (the stream aborted the request)
                if not job.finished:
                    job.status = RequestStatus.CANCELLED
                job.seal()
                self.jobs.save(job)

    def _apply(self, job: Job, event: OmniEvent) -> None:
        if isinstance(event, StatusEvent):
            if event.resolved is not None:  # admission's values: the job reports what runs
                job.geometry = job.geometry.admitted(event.resolved, event.steps)
            changed, job.status = job.status is not event.status, event.status
            if changed:
                self.jobs.save(job)
        elif isinstance(event, ProgressEvent):
            job.loop_nodes.add(event.node)
            job.progress = min(99, max(job.progress, int(100 * event.step / max(event.total, 1))))
        job.publish(event.to_dict())

    async def _finish(self, job: Job, final: FinalEvent) -> None:
        output = final.output
        status, failure = output.status, output.failure
        if status is RequestStatus.COMPLETED:
            try:
                await asyncio.to_thread(lambda: self.jobs.keep(job, encode_outputs(job.kind, output, job.audio_format, job.prompt)))
            except Exception as e:
                logger.exception("encoding or writing the output of %s failed", job.id)
                status, failure = RequestStatus.FAILED, Failure(kind=ErrorKind.STAGE_ERROR,
                                                                message=f"encoding or writing the output failed: {e}")
        job.metrics = output.metrics.to_dict()
        job.weight_version = output.weight_version
        if output.video is not None:  # a multi-stage graph may change the size (LTX-2's two-stage path doubles it)
            frames = output.video.frames  # [F, H, W, 3]
            job.geometry = replace(job.geometry, height=int(frames.shape[1]), width=int(frames.shape[2]))
        action = output.artifacts.get("action")
        if action is not None and hasattr(action, "tensor"):
            job.actions = action.tensor.float().tolist()
        job.completed_at = int(time.time())
        job.failure = failure
        job.progress = 100 if status is RequestStatus.COMPLETED else job.progress
        job.status = status
        self.metrics.observe_finished(job.kind.value, status, output.metrics, job.loop_nodes)
        event = final.to_dict()
        event["output"]["status"], event["output"]["error"] = status.value, job.error
        event["output"]["failure"] = None if failure is None else failure.to_dict()
        job.publish(event)
        job.seal()
        self.jobs.save(job)  # a durable store: the row says completed only now, files written
        self.jobs.sweep()
