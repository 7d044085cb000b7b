"""Video files: H.264 mp4 (with an optional AAC soundtrack) writing and reading through PyAV (FFmpeg)."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from omniloop.io.audio import add_audio_stream, as_float_samples, check_rate, mux_audio
from omniloop.io.files import written_whole
from omniloop.request import ErrorKind, InvalidRequest


def _as_uint8_frames(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = frames.detach().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"frames must be [F, H, W, 3], got shape {arr.shape}")
    if arr.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {arr.dtype}; convert with (x * 255).round().clip(0, 255)")
    return np.ascontiguousarray(arr)


def write_mp4(
    frames: torch.Tensor | np.ndarray, dest: str | Path | BinaryIO, fps: int, *, crf: int = 18, preset: str = "medium",
    audio: torch.Tensor | np.ndarray | None = None, sample_rate: int | None = None, audio_bitrate: int = 192_000,
    title: str | None = None,
) -> None:
    """Encode ``frames`` ([F, H, W, 3] uint8) as H.264/yuv420p mp4 into a path or binary file,
    with ``audio`` (float32 [channels, samples] in [-1, 1] at ``sample_rate``) as an AAC track.
    ``title``: the file's title tag (generated clips carry their prompt there: ``mp4_title``)."""
    import av

    arr = _as_uint8_frames(frames)
    f, h, w, _ = arr.shape
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {h}x{w}")
    sound: np.ndarray | None = None  # [channels, samples] float32 at ``rate``
    rate = 0
    if audio is not None:
        if sample_rate is None:
            raise ValueError("audio needs its sample_rate; pass sample_rate=<Hz>")
        sound, rate = as_float_samples(audio, sample_rate), sample_rate
        check_rate("aac", sample_rate)
    with written_whole(dest) as target, av.open(target, mode="w", format="mp4") as container:
        if title:
            container.metadata["title"] = title
        stream = container.add_stream("libx264", rate=Fraction(int(fps), 1))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        track = None
        if sound is not None:
            track = add_audio_stream(container, "aac", sound, rate, "fltp")
            track.bit_rate = audio_bitrate
        for frame in arr:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
        if track is not None and sound is not None:  # the muxer interleaves the two streams by timestamp
            mux_audio(container, track, sound, rate, "fltp")


def encode_mp4(frames: torch.Tensor | np.ndarray, fps: int, **kwargs) -> bytes:
    buf = io.BytesIO()
    write_mp4(frames, buf, fps, **kwargs)
    return buf.getvalue()


def mp4_title(path: str | Path) -> str | None:
    """The title tag ``write_mp4`` wrote (a generated clip's prompt), or None."""
    import av

    with av.open(str(path)) as container:
        return container.metadata.get("title") or None


def read_video(source: str | Path | bytes | BinaryIO) -> tuple[np.ndarray, float]:
    """Decode every frame: ([F, H, W, 3] uint8, fps)."""
    import av

    src = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        container = av.open(str(src) if isinstance(src, (str, Path)) else src, mode="r")
    except (av.error.InvalidDataError, av.error.FileNotFoundError, OSError) as e:
        raise InvalidRequest(f"cannot read video {source if isinstance(source, (str, Path)) else '<bytes>'}: {e}",
                             fields=("inputs",)) from None
    with container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        fps = float(stream.average_rate) if stream.average_rate else 0.0
    if not frames:
        raise InvalidRequest("video has no decodable frames", fields=("inputs",))
    return np.stack(frames), fps


def probe_video(source: bytes, max_pixels: int | None = None) -> None:
    """Raise ValueError (as :func:`read_video` words it) unless ``source`` opens as a video and
    its first frame decodes: a cheap check at the wire, before a request is queued. With
    ``max_pixels``, the frame size in the stream's header is checked first, before any decode."""
    import av

    try:
        with av.open(io.BytesIO(source), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequest("cannot read video <bytes>: it has no video stream", fields=("inputs",))
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if max_pixels is not None and width * height > max_pixels:
                raise InvalidRequest(f"its frames are {width}x{height} = {width * height:,} pixels, over this "
                                     f"server's {max_pixels:,} (max_image_pixels); send a smaller video",
                                     fields=("inputs",), kind=ErrorKind.LIMIT_EXCEEDED)
            next(container.decode(stream))
    except (av.error.FFmpegError, OSError, StopIteration) as e:
        raise InvalidRequest(f"cannot read video <bytes>: {e or 'no decodable frame'}", fields=("inputs",)) from None


def video_frames(source: Any) -> np.ndarray:
    """[F, H, W, 3] uint8 frames from a path, file bytes, an array / tensor of that layout, or a
    list of PIL images. Unreadable or wrongly shaped input raises ValueError naming it."""
    if isinstance(source, (str, Path, bytes)):
        return read_video(source)[0]
    if isinstance(source, (list, tuple)):
        from omniloop.io.image import open_image

        if not source:
            raise InvalidRequest("video has no frames", fields=("inputs",))
        frames = [np.asarray(open_image(frame)) for frame in source]
        odd = next((i for i, f in enumerate(frames) if f.shape != frames[0].shape), None)
        if odd is not None:
            raise InvalidRequest(f"its frames differ in size: frame 0 is {frames[0].shape[1]}x{frames[0].shape[0]}, "
                                 f"frame {odd} {frames[odd].shape[1]}x{frames[odd].shape[0]}; pass frames of one size",
                                 fields=("inputs",))
        return np.stack(frames)
    return _as_uint8_frames(source)


def load_video_part(part: Any) -> np.ndarray:
    """[F, H, W, 3] uint8 frames of a VideoPart (path, base64 or in-process data)."""
    if part.data is not None:
        return video_frames(part.data)
    return video_frames(part.raw_bytes() if part.b64 is not None else part.path)


def video_to_tensor(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[F, H, W, 3] uint8 -> [1, 3, F, height, width] float32 in [-1, 1], each frame resized
    like a conditioning image (Lanczos; diffusers' VideoProcessor)."""
    from PIL import Image

    from omniloop.io.image import image_to_tensor

    per_frame = [image_to_tensor(Image.fromarray(frame), height, width) for frame in frames]  # [1, 3, H, W] each
    return torch.stack(per_frame, dim=2)
