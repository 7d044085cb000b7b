"""Streamed video chunks for HTTP clients: each partial ``video_chunk`` artifact of a job (a
causal video model's chunk, emitted the moment it is decoded) becomes one fragmented-MP4
media segment, carried base64 in that chunk's SSE / WebSocket event under ``"fmp4"``; the
job's first chunk event also carries the init segment. A browser appends
``init`` and then each ``segment`` to a ``MediaSource`` ``SourceBuffer`` opened with
``mime`` and plays the video while it is being made.

One :class:`ChunkSegments` per server keeps one encoder state per streaming job, dropped
when the job ends.
"""

from __future__ import annotations

import base64
from typing import Any, TypeGuard

from omniloop.io.fmp4 import MIME, FragmentedMP4Stream
from omniloop.request import ArtifactEvent, VideoChunkArtifact


def is_video_chunk(event: Any) -> TypeGuard[ArtifactEvent]:
    return isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, VideoChunkArtifact)


class ChunkSegments:
    def __init__(self) -> None:
        self._streams: dict[str, FragmentedMP4Stream] = {}

    def segment(self, job_id: str, artifact: VideoChunkArtifact) -> dict[str, Any]:
        """The ``"fmp4"`` payload of one chunk: its media segment (and, first, the init segment)."""
        stream = self._streams.get(job_id)
        first = stream is None
        if stream is None:
            _, height, width, _ = artifact.frames.shape
            stream = self._streams[job_id] = FragmentedMP4Stream(width, height, artifact.fps)
        media = stream.add_chunk(artifact.frames)
        payload: dict[str, Any] = {"mime": MIME, "index": artifact.index,
                                   "segment": base64.b64encode(media).decode("ascii")}
        if first:
            assert stream.init_segment is not None
            payload["init"] = base64.b64encode(stream.init_segment).decode("ascii")
        return payload

    def event(self, job_id: str, event: ArtifactEvent) -> dict[str, Any]:
        """``event.to_dict()`` with the chunk's ``"fmp4"`` payload (encodes: run it off the event loop)."""
        assert isinstance(event.artifact, VideoChunkArtifact)
        return {**event.to_dict(), "fmp4": self.segment(job_id, event.artifact)}

    def close(self, job_id: str) -> None:
        self._streams.pop(job_id, None)
