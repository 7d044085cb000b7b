"""Request handlers the Dynamo runtime calls, one coroutine per request, all feeding one
``AsyncEngine``: concurrent requests are multiplexed (and batched) by our StepScheduler,
never serialized behind a lock.

Per request: map the wire object (bad fields -> ``InvalidArgument``, HTTP 400 with our
validation message), submit, watch the request context (a client disconnect aborts the
request in the engine at its next step boundary, which frees its state), and answer with
Dynamo's response objects carrying our cost annotation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from omniloop.engine import AsyncEngine, EngineDeadError, RequestRejected, UnknownRequest
from omniloop.io.video import encode_mp4
from omniloop.request import (
    ArtifactEvent,
    ErrorKind,
    FinalEvent,
    LatentsArtifact,
    OmniEvent,
    OmniOutput,
    OmniRequest,
    ProgressEvent,
    RequestStatus,
    StatusEvent,
    VideoChunkArtifact,
    new_request_id,
)
from omniloop.serve.dynamo.events import EventMessages
from omniloop.serve.dynamo.frames import jpeg_b64, latent_preview, png_b64
from omniloop.serve.dynamo.mapping import cost_annotation, image_response, video_data, video_response
from omniloop.serve.dynamo.metrics import WorkerMetrics
from omniloop.serve.wire import ServedModel, dynamo_images, dynamo_video

logger = logging.getLogger(__name__)
HEALTH_CHECK_KEY = "_HEALTH_CHECK"  # Dynamo's canary marker (dynamo.health_check.HEALTH_CHECK_KEY)


def dynamo_error(error: Exception, *, draining: bool = False) -> Exception:
    """Our engine's admission errors -> Dynamo's typed errors (the frontend's HTTP codes).

    ``InvalidArgument`` keeps our message (400); ``HttpError(429)`` is a full queue;
    ``EngineShutdown`` (503) a draining or dead engine.
    """
    from dynamo.llm.exceptions import EngineShutdown, HttpError, InvalidArgument

    kind = error.kind if isinstance(error, RequestRejected) else None
    if kind is ErrorKind.DRAINING or (kind is ErrorKind.QUEUE_FULL and draining):
        return EngineShutdown(f"worker is shutting down and accepts no new requests: {error}")
    if kind is ErrorKind.QUEUE_FULL:
        return HttpError(429, str(error))
    if isinstance(error, EngineDeadError):
        return EngineShutdown(str(error))
    if isinstance(error, ValueError):  # RequestRejected (any other kind), a WireError
        return InvalidArgument(str(error))
    return error


@dataclass
class _Tracked:
    """What a handler learns about its request while it runs."""

    request: OmniRequest  # as sent, then as admission resolved it (the queued event's)
    started: float
    predicted_s: float | None = None
    steps: int | None = None  # the denoising steps that run (admission's)
    streamed: int = 0  # video frames already sent as their chunks were made (causal models)

    def annotation(self, output: OmniOutput | None = None) -> dict[str, Any]:
        note = cost_annotation(self.request.request_id, self.predicted_s, output.metrics if output else None)
        return note if output is None else {**note, "weight_version": output.weight_version}  # the weights it ran on


class GenerationHandler:
    def __init__(self, engine: AsyncEngine, model: ServedModel, metrics: WorkerMetrics, *, drain_timeout_s: float) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.draining = False

    # -- endpoints ------------------------------------------------------------------------
    # NOTE: the runtime passes the request context by keyword: the parameter must be named
    # ``context`` (a handler without it gets no context, hence no cancellation).
    async def videos(self, body: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """``/v1/videos``: one terminal response with the mp4. ``stream: true``
        (``/v1/videos/stream``): one JPEG per chunk — a progress frame per denoise step
        from the partial latents, then the video's frames; with ``nvext.stream_format:
        "events"``, one typed message per OmniEvent (fMP4 fragments, PCM chunks: events.py)."""
        if body.get(HEALTH_CHECK_KEY) is True:
            yield self._canary_response()
            return
        call = self._resolve(dynamo_video, body, context)
        tracked = _Tracked(call.request, time.perf_counter())
        if call.events:
            async for message in self._event_stream(tracked, context):
                yield message
            return
        async for event in self._run(tracked, context):
            if call.stream and isinstance(event, ArtifactEvent) and isinstance(event.artifact, LatentsArtifact):
                yield await asyncio.to_thread(self._preview_chunk, tracked, event.artifact)
            elif call.stream and isinstance(event, ArtifactEvent) and isinstance(event.artifact, VideoChunkArtifact):
                # a causal model's chunk, decoded: its frames go out now, not after the last chunk
                # (the video's very last frame waits for the final response, which it closes)
                art = event.artifact
                last_chunk = art.num_chunks is not None and art.index == art.num_chunks - 1
                for i, frame in enumerate(art.frames[:-1] if last_chunk else art.frames):
                    yield await asyncio.to_thread(self._frame_chunk, tracked, frame, art.first_frame + i, art.fps)
                tracked.streamed = art.first_frame + art.num_frames - last_chunk
            elif isinstance(event, FinalEvent):
                async for chunk in self._video_final(tracked, event.output, stream=call.stream):
                    yield chunk

    async def images(self, body: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """``/v1/images/generations`` for image-capable (T2I) models: ``n`` requests run
        concurrently in the engine (and batch), answered as one ``NvImagesResponse``."""
        call = self._resolve(dynamo_images, body, context)
        tracks = [_Tracked(r, time.perf_counter()) for r in call.requests]
        runs = [asyncio.ensure_future(self._final_output(t, context)) for t in tracks]
        try:
            outputs = await asyncio.gather(*runs)
        except BaseException:  # one was refused (e.g. a full queue): abort its siblings
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        failed = [o for o in outputs if o.status is not RequestStatus.COMPLETED]
        if failed:
            from dynamo.llm.exceptions import Unknown

            raise Unknown(f"image generation {failed[0].status.value}: {failed[0].error}")
        images = [_image(o) for o in outputs]
        pngs = await asyncio.gather(*(asyncio.to_thread(png_b64, image) for image in images))
        yield image_response(list(pngs), [t.annotation(o) for t, o in zip(tracks, outputs)])

    # -- one request ---------------------------------------------------------------------
    def _resolve(self, build: Any, body: dict[str, Any], context: Any) -> Any:
        rid = (context.id() if context is not None else None) or new_request_id()
        try:
            return build(body, rid, self.model)
        except ValueError as e:
            raise dynamo_error(e) from None

    async def _run(self, tracked: _Tracked, context: Any) -> AsyncIterator[OmniEvent]:
        """The request's engine events; a stopped context aborts it at the next step."""
        rid = tracked.request.request_id
        stream = self.engine.stream(tracked.request)
        try:
            first = await stream.__anext__()  # submits: admission errors raise here
        except Exception as e:
            raise dynamo_error(e, draining=self.draining) from None
        watcher = asyncio.ensure_future(self._abort_on_stop(rid, context))
        try:
            event: OmniEvent | None = first
            while event is not None:
                if isinstance(event, StatusEvent) and event.status is RequestStatus.QUEUED:
                    tracked.predicted_s = event.predicted_cost_s
                    if event.resolved is not None:  # previews at the size and step count that run
                        tracked.request, tracked.steps = event.resolved, event.steps
                    self.metrics.admitted(tracked.predicted_s)
                elif isinstance(event, FinalEvent):
                    self.metrics.finished(tracked.predicted_s, event.output.metrics.actual_cost_s)
                yield event
                event = await anext(stream, None)
        finally:
            watcher.cancel()
            await stream.aclose()  # an unfinished request is aborted here (caller went away)

    async def _abort_on_stop(self, request_id: str, context: Any) -> None:
        if context is None:
            return
        await context.async_killed_or_stopped()
        logger.info("request %s: client went away; aborting at the next step", request_id)
        with contextlib.suppress(UnknownRequest):
            await self.engine.abort(request_id)

    async def _final_output(self, tracked: _Tracked, context: Any) -> OmniOutput:
        async for event in self._run(tracked, context):
            if isinstance(event, FinalEvent):
                return event.output
        raise AssertionError("engine stream ended without a final event")

    # -- responses -------------------------------------------------------------------------
    async def _event_stream(self, tracked: _Tracked, context: Any) -> AsyncIterator[dict[str, Any]]:
        """Every engine event as one typed message (``nvext.event``: the event with its
        ``schema_version``; ``data``: the media it makes); the final event's closes the stream."""
        rid, name = tracked.request.request_id, self.model.name
        messages = EventMessages()
        async for event in self._run(tracked, context):
            media = await asyncio.to_thread(messages.media, event)
            nvext = {**tracked.annotation(), "event": event.to_dict(), "media": media.media}
            if not isinstance(event, FinalEvent):
                progress = round(100 * event.step / max(1, event.total)) if isinstance(event, ProgressEvent) else 0
                yield video_response(rid, name, status="in_progress", progress=min(99, progress), data=media.data,
                                     nvext=nvext)
                continue
            output, elapsed = event.output, time.perf_counter() - tracked.started
            nvext.update(tracked.annotation(output))
            if output.status is RequestStatus.COMPLETED:
                yield video_response(rid, name, status="completed", progress=100, data=media.data, nvext=nvext,
                                     inference_time_s=elapsed)
            else:
                yield video_response(rid, name, status="failed", progress=0, data=[], nvext=nvext,
                                     error=self._failure(output), inference_time_s=elapsed)

    async def _video_final(self, tracked: _Tracked, output: OmniOutput, *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        rid, name = tracked.request.request_id, self.model.name
        elapsed = time.perf_counter() - tracked.started
        if output.status is not RequestStatus.COMPLETED:
            yield video_response(rid, name, status="failed", progress=0, data=[], nvext=tracked.annotation(output),
                                 error=self._failure(output), inference_time_s=elapsed)
            return
        frames, fps = _frames(output)
        if not stream:
            mp4 = await asyncio.to_thread(encode_mp4, frames, fps)
            data = [video_data(base64.b64encode(mp4).decode("ascii"), "mp4", fps)]
            yield video_response(rid, name, status="completed", progress=100, data=data,
                                 nvext=tracked.annotation(output), inference_time_s=elapsed)
            return
        for i, frame in enumerate(frames):
            last = i == len(frames) - 1
            if i < tracked.streamed:
                continue  # streamed as its chunk was made
            jpeg = await asyncio.to_thread(jpeg_b64, frame)
            yield video_response(rid, name, status="completed" if last else "in_progress", progress=100,
                                 data=[video_data(jpeg, "jpeg", fps)],
                                 nvext={**tracked.annotation(output), "frame": {"kind": "video", "index": i}},
                                 inference_time_s=elapsed if last else None)

    def _frame_chunk(self, tracked: _Tracked, frame: Any, index: int, fps: int) -> dict[str, Any]:
        """One frame of a streamed chunk (a causal video model's), as the final frames are."""
        return video_response(tracked.request.request_id, self.model.name, status="in_progress", progress=99,
                              data=[video_data(jpeg_b64(frame), "jpeg", fps)],
                              nvext={**tracked.annotation(), "frame": {"kind": "video", "index": index}})

    def _preview_chunk(self, tracked: _Tracked, art: LatentsArtifact) -> dict[str, Any]:
        d, p = self.model.defaults, tracked.request.diffusion
        height, width = p.height or d.height or 256, p.width or d.width or 256
        total = max(1, tracked.steps if tracked.steps is not None else p.num_steps(d.steps))
        step = art.step or 0
        jpeg = jpeg_b64(latent_preview(art.latents, height, width))
        return video_response(tracked.request.request_id, self.model.name, status="in_progress",
                              progress=min(99, round(100 * step / total)), data=[video_data(jpeg, "jpeg")],
                              nvext={**tracked.annotation(), "frame": {"kind": "preview", "step": step}})

    def _failure(self, output: OmniOutput) -> str:
        if output.status is RequestStatus.CANCELLED and self.draining:
            return (f"cancelled: the worker shut down and its drain grace period ({self.drain_timeout_s:g} s) "
                    "ran out; retry the request")
        return f"{output.status.value}: {output.error}"

    def _canary_response(self) -> dict[str, Any]:
        """Dynamo's idle health canary: answer from engine state, without generating."""
        if not self.engine.stats()["alive"]:
            from dynamo.llm.exceptions import EngineShutdown

            raise EngineShutdown("omniloop engine thread is not running")
        return video_response("health-check", self.model.name, status="completed", progress=100, data=[],
                              nvext={"alive": True})

    # -- lifecycle -----------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, let in-flight requests finish, cancel what is left after the
        grace period (their callers get a ``failed`` response saying so)."""
        self.draining = True
        t0 = time.perf_counter()
        before = self.engine.stats()
        await self.engine.drain(timeout=self.drain_timeout_s)
        after = self.engine.stats()
        logger.info("drained in %.2fs: %d completed, %d cancelled", time.perf_counter() - t0,
                    after["completed"] - before["completed"], after["cancelled"] - before["cancelled"])


def _image(output: OmniOutput) -> Any:
    """[H, W, 3] uint8 of a completed image generation."""
    assert output.image is not None, f"image request {output.request_id} completed without an image"
    return output.image.image


def _frames(output: OmniOutput) -> tuple[Any, int]:
    """[F, H, W, 3] uint8 frames and fps of a finished video (an image is one frame)."""
    if output.video is not None:
        return output.video.frames.numpy(), int(output.video.fps)
    assert output.image is not None, "a completed generation has a video or an image"
    return output.image.image[None].numpy(), 1
