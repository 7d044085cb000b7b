"""Fragmented MP4 segments: each media segment parses with PyAV when prefixed by the init
segment, and init + every segment decodes to the whole clip's frames (timestamps continuous)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from omniloop.io.fmp4 import FragmentedMP4Stream, _boxes

H, W, FPS = 32, 48, 16
CHUNKS = (1, 4, 4, 8)


def _clip(frames: int) -> np.ndarray:
    """Smooth moving gradients (H.264 keeps them within a few levels)."""
    y, x = np.mgrid[0:H, 0:W]
    out = [np.stack([x * 4 + 2 * t, y * 5 + 3 * t, np.full_like(x, 60 + 8 * t)], -1) for t in range(frames)]
    return np.asarray(out, dtype=np.uint8)


def _decode(data: bytes) -> tuple[np.ndarray, list[float]]:
    import av

    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(video=0))
    return np.stack([f.to_ndarray(format="rgb24") for f in frames]), [float(f.time) for f in frames]


def test_init_then_one_media_segment_per_chunk_decodes_to_the_clip():
    clip = _clip(sum(CHUNKS))
    stream = FragmentedMP4Stream(W, H, FPS)
    segments, start = [], 0
    for n in CHUNKS:
        segments.append(stream.add_chunk(clip[start : start + n]))
        start += n
    init = stream.init_segment
    assert [k for k, _, _ in _boxes(init)] == ["ftyp", "moov"]
    frames, times = _decode(init + b"".join(segments))
    assert frames.shape == clip.shape
    assert times == pytest.approx([i / FPS for i in range(len(clip))])  # one timeline across segments
    assert np.abs(frames.astype(int) - clip.astype(int)).mean() < 3.0  # the clip, up to H.264 loss
    start = 0
    for i, (seg, n) in enumerate(zip(segments, CHUNKS)):
        assert [k for k, _, _ in _boxes(seg)] == ["moof", "mdat"]  # one fragment, made when the chunk was
        alone, _ = _decode(init + seg)  # a segment alone parses after the init segment...
        assert np.array_equal(alone, frames[start : start + n]), i  # ... to the same frames
        start += n


def test_bad_chunks_are_refused():
    stream = FragmentedMP4Stream(W, H, FPS)
    with pytest.raises(ValueError, match="48x32"):
        stream.add_chunk(np.zeros((2, H + 2, W, 3), np.uint8))
    with pytest.raises(ValueError, match="even"):
        FragmentedMP4Stream(W + 1, H, FPS)
