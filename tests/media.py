"""Decoded media for assertions: mp4 bytes (or their base64) -> frames, and a comparison that
says where two videos differ.

Why frames, not bytes, where two requests of one process are compared: x264 turns a one-level
change of one pixel into different bytes, and a request's floats can move by an ulp with the
CPU threads its one-shot nodes ran on (engine/fanout.py's workers, a recomputed text embedding
after a weight update, requests batched together or not as their arrival timing falls) - seen in
CI under the full suite: fleet flf, the weights round trip and sleep / wake, each time the same
0.382 levels on average (one x264 decision on the 32x32 toy clip), max 14-19; concurrent requests
that batch differently from run to run moved it by 0.66 (the fleet test now sends them in turn).
Bit-equality of the outputs themselves is asserted in-process (tests/engine/test_weights.py).
"""

from __future__ import annotations

import base64
import io

import av
import numpy as np


def mp4_frames(data: bytes | str) -> np.ndarray:
    """[F, H, W, 3] uint8 frames of an mp4 given as bytes or base64 text."""
    raw = base64.b64decode(data) if isinstance(data, str) else data
    with av.open(io.BytesIO(raw)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def frame_diff(a: bytes | str, b: bytes | str) -> tuple[float, int]:
    """(mean, max) absolute difference in 8-bit levels between two videos' decoded frames."""
    fa, fb = mp4_frames(a), mp4_frames(b)
    assert fa.shape == fb.shape, (fa.shape, fb.shape)
    d = np.abs(fa.astype(np.int16) - fb.astype(np.int16))
    return float(d.mean()), int(d.max())


def assert_same_video(a: bytes | str, b: bytes | str, *, mean: float = 0.6, peak: int = 32) -> None:
    """Equal bytes, or decoded frames within ``mean`` levels on average (and ``peak`` at worst):
    the same video re-encoded after an ulp moved (seen: 0.382 mean, 19 max). A different seed,
    condition or weights moves the mean by levels (measured: 11 for perturbed weights, 2.7 for a
    video without its last frame; the tests that call this assert more than 1 level)."""
    if a == b:
        return
    m, p = frame_diff(a, b)
    assert m <= mean and p <= peak, f"videos differ: mean {m:.3f} levels, max {p} (allowed {mean}, {peak})"
