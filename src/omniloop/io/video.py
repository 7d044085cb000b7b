"""Video files: H.264 mp4 writing and reading through PyAV (FFmpeg)."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch


def _as_uint8_frames(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = frames.detach().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"frames must be [F, H, W, 3], got shape {arr.shape}")
    if arr.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {arr.dtype}; convert with (x * 255).round().clip(0, 255)")
    return np.ascontiguousarray(arr)


def write_mp4(
    frames: torch.Tensor | np.ndarray, dest: str | Path | BinaryIO, fps: int, *, crf: int = 18, preset: str = "medium"
) -> None:
    """Encode ``frames`` ([F, H, W, 3] uint8) as H.264/yuv420p mp4 into a path or binary file."""
    import av

    arr = _as_uint8_frames(frames)
    f, h, w, _ = arr.shape
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {h}x{w}")
    target = str(dest) if isinstance(dest, (str, Path)) else dest
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(int(fps), 1))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        for frame in arr:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))


def encode_mp4(frames: torch.Tensor | np.ndarray, fps: int, **kwargs) -> bytes:
    buf = io.BytesIO()
    write_mp4(frames, buf, fps, **kwargs)
    return buf.getvalue()


def read_video(source: str | Path | bytes | BinaryIO) -> tuple[np.ndarray, float]:
    """Decode every frame: ([F, H, W, 3] uint8, fps)."""
    import av

    src = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        container = av.open(str(src) if isinstance(src, (str, Path)) else src)
    except (av.error.InvalidDataError, av.error.FileNotFoundError, OSError) as e:
        raise ValueError(f"cannot read video {source if isinstance(source, (str, Path)) else '<bytes>'}: {e}") from None
    with container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        fps = float(stream.average_rate) if stream.average_rate else 0.0
    if not frames:
        raise ValueError("video has no decodable frames")
    return np.stack(frames), fps
