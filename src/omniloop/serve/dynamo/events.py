"""``nvext.stream_format: "events"``: a streamed request's ``OmniEvent`` s as typed messages
(design §6.3.6 ask A3's wire format), instead of one JPEG per frame.

Every event the engine emits becomes one ``NvVideosResponse`` chunk whose
``nvext.event`` is the event's ``to_dict()`` (``type``, ``schema_version``, ``request_id``...)
and whose ``data`` carries the media the event makes, base64:

* a partial video chunk (a causal model's ``VideoChunkArtifact``): its fragmented-MP4 media
  segment (``output_format: "fmp4"``; the first one prefixed with the init segment);
* a partial audio artifact: its samples as raw PCM (``"pcm_s16le"``, interleaved, with
  ``sample_rate`` and ``channels`` in ``nvext.media``);
* a partial text artifact: no media; the delta is the event's ``artifact.text``;
* status and progress events: no media;
* the final event closes the stream (``status`` completed or failed) with the media not yet
  streamed: a whole video as fMP4 when no chunk was (init + one segment), a whole audio
  track as WAV when no audio chunk was.

So the ``fmp4`` payloads of a stream, concatenated in order, are one playable mp4, and
``pcm_s16le`` payloads one PCM track. Encoding runs off the event loop (the caller's
``asyncio.to_thread``). One :class:`EventMessages` per request.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniloop.io.fmp4 import MIME, FragmentedMP4Stream
from omniloop.request import (
    ArtifactEvent,
    AudioArtifact,
    FinalEvent,
    OmniEvent,
    OmniOutput,
    RequestStatus,
    VideoChunkArtifact,
)

STREAM_FORMATS = ("jpeg", "events")  # nvext.stream_format; jpeg: the frontend's multipart frames


@dataclass
class Message:
    """One stream message's media: ``data`` entries and ``nvext.media`` (empty: none)."""

    data: list[dict[str, Any]] = field(default_factory=list)
    media: list[dict[str, Any]] = field(default_factory=list)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def pcm_s16le(samples: Any) -> bytes:
    """[channels, n] float in [-1, 1] -> interleaved little-endian int16 PCM."""
    arr = samples.detach().float().cpu().numpy() if hasattr(samples, "detach") else np.asarray(samples, np.float32)
    ints = np.clip(np.round(arr * 32767.0), -32768, 32767).astype("<i2")  # [channels, n]
    return np.ascontiguousarray(ints.T).tobytes()  # [n, channels]: interleaved


class EventMessages:
    """A request's events -> typed messages' media, keeping its fMP4 encoder."""

    def __init__(self) -> None:
        self._video: FragmentedMP4Stream | None = None
        self._audio_chunks = 0

    def media(self, event: OmniEvent) -> Message:
        """The media ``event`` carries (encodes: run it off the event loop)."""
        if isinstance(event, ArtifactEvent) and event.partial:
            art = event.artifact
            if isinstance(art, VideoChunkArtifact):
                return self._video_segment(art.frames, art.fps, index=art.index)
            if isinstance(art, AudioArtifact):
                self._audio_chunks += 1
                return self._pcm(art, index=self._audio_chunks - 1)
            return Message()
        if isinstance(event, FinalEvent):
            return self._final(event.output)
        return Message()

    def _video_segment(self, frames: Any, fps: int, *, index: int) -> Message:
        first = self._video is None
        if self._video is None:
            _, height, width, _ = frames.shape
            self._video = FragmentedMP4Stream(int(width), int(height), int(fps))
        segment = self._video.add_chunk(frames)
        assert self._video.init_segment is not None
        raw = (self._video.init_segment + segment) if first else segment
        return Message(data=[{"output_format": "fmp4", "b64_json": _b64(raw), "fps": int(fps)}],
                       media=[{"kind": "video", "format": "fmp4", "mime": MIME, "index": index, "init": first}])

    def _pcm(self, art: AudioArtifact, *, index: int) -> Message:
        channels = int(art.samples.shape[0])
        return Message(data=[{"output_format": "pcm_s16le", "b64_json": _b64(pcm_s16le(art.samples))}],
                       media=[{"kind": "audio", "format": "pcm_s16le", "sample_rate": art.sample_rate,
                               "channels": channels, "index": index}])

    def _final(self, output: OmniOutput) -> Message:
        out = Message()
        if output.status is not RequestStatus.COMPLETED:
            return out
        if self._video is None:  # nothing streamed: the whole video (or image) as one fragment
            frames, fps = _frames(output)
            if frames is not None:
                part = self._video_segment(frames, fps, index=0)
                out.data += part.data
                out.media += part.media
        audio = output.audio
        if audio is not None and self._audio_chunks == 0:
            from omniloop.io.audio import encode_audio

            out.data.append({"output_format": "wav", "b64_json": _b64(encode_audio(audio.samples, audio.sample_rate))})
            out.media.append({"kind": "audio", "format": "wav", "sample_rate": audio.sample_rate,
                              "channels": int(audio.samples.shape[0])})
        return out


def _frames(output: OmniOutput) -> tuple[Any, int]:
    """[F, H, W, 3] uint8 frames and fps of a finished video or image; (None, 0) without either."""
    if output.video is not None:
        return output.video.frames, int(output.video.fps)
    if output.image is not None:
        return output.image.image[None], 1
    return None, 0
