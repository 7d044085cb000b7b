"""Temporal stability of a shapes-world clip: does it still look like the world at its last frame?

The world's clips keep one uniform background and a fixed set of separated, solid objects
from the first frame to the last. A generator (or a VAE) that breaks down late in a clip
darkens or tints the background, grows dark trails and colored blotches, or splits an
object in two, while color, shape and motion (read from the whole clip) can still come out
right: issue 15's videos scored 70-100% adherence with frames 13-16 collapsed. So each
frame ``t`` gets three scores:

* ``background_drift``: RGB distance of its background (median of the 2-pixel border ring,
  as ``detect`` reads it) from frame 0's;
* ``objects``: separated solid blobs of palette colors (4-connected pixels of one color,
  each at least ``min_area``), compared with the clip's usual count (the most common one
  over its frames): the world never adds, drops or splits an object mid-clip;
* ``artifact_fraction``: the share of its pixels that neither the background nor any
  object color explains, i.e. lie farther than ``ARTIFACT_DISTANCE`` (RGB) from every
  segment background -> palette color (anti-aliased edges and blur lie on a segment).

A frame fails when any score is past its threshold; a clip is stable when no frame fails.
Thresholds were set on ground truth (clean, H.264 round trip, blurred + noisy: every frame
passes with a wide margin, tests/eval/test_stability.py: drift <= 0.2, artifacts <= 0.05%)
against the session-5 models: frames 0-8 of 16 student videos drift <= 7.1 with <= 0.05%
artifacts, their frames 13-16 drift 18-169 (every clip), and the VAE's own round trip of
ground truth drifts 18-142 there with up to 93% artifacts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniloop.eval.shapes_world import COLORS

MAX_DRIFT = 15.0  # RGB distance of a frame's background from frame 0's
ARTIFACT_DISTANCE = 40.0  # RGB distance from every background -> color segment that makes a pixel an artifact
MAX_ARTIFACT_FRACTION = 0.01  # of a frame's pixels
_MIN_AREA = 0.06  # a counted blob covers at least (0.06 * side)^2 pixels (adherence's object threshold)

_PALETTE = np.asarray(list(COLORS.values()), dtype=np.float32)  # [K, 3]
PROBLEMS = ("background", "objects", "artifacts")


@dataclass(frozen=True, slots=True)
class FrameStability:
    index: int
    background_drift: float  # RGB distance from frame 0's background
    objects: int  # separated palette-colored blobs
    artifact_fraction: float  # 0..1
    problems: tuple[str, ...]  # the scores past their thresholds (of PROBLEMS)


@dataclass(frozen=True, slots=True)
class StabilityScore:
    frames: tuple[FrameStability, ...]
    usual_objects: int  # the most common per-frame object count (ties: the earlier frame's)

    @property
    def stable(self) -> bool:
        return not self.failing_frames

    @property
    def failing_frames(self) -> tuple[int, ...]:
        return tuple(f.index for f in self.frames if f.problems)

    def explain(self) -> str:
        """'stable', or which frames fail and why (for test messages and reports)."""
        bad = [f for f in self.frames if f.problems]
        if not bad:
            return "stable"
        parts = [f"frame {f.index}: {', '.join(f.problems)} (drift {f.background_drift:.0f}, "
                 f"{f.objects} objects vs {self.usual_objects}, artifacts {100 * f.artifact_fraction:.1f}%)"
                 for f in bad]
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"stable": self.stable, "failing_frames": list(self.failing_frames),
                "usual_objects": self.usual_objects,
                "background_drift": [round(f.background_drift, 1) for f in self.frames],
                "objects": [f.objects for f in self.frames],
                "artifact_fraction": [round(f.artifact_fraction, 4) for f in self.frames]}


def score_stability(frames: np.ndarray, bg: np.ndarray, labels: np.ndarray) -> StabilityScore:
    """Per-frame stability of uint8 ``frames`` [F, H, W, 3], given their per-frame
    background ``bg`` [F, 3] and palette ``labels`` [F, H, W] (-1: no object color), as
    ``adherence.detect`` computes them."""
    f, h, w, _ = frames.shape
    drift = np.sqrt(((bg - bg[:1]) ** 2).sum(-1))  # [F]
    # NOTE: areas are read on every second row and column from 64 px up (a quarter of the
    # pixels, ~4x faster; blobs and artifact shares are areas, which this estimates)
    stride = 2 if min(h, w) >= 64 else 1
    frames, labels = frames[:, ::stride, ::stride], labels[:, ::stride, ::stride]
    counts = blob_counts(labels, max(4.0, (_MIN_AREA * min(h, w)) ** 2) / stride**2)  # [F]
    usual = int(np.bincount(counts).argmax())
    artifacts = artifact_fractions(frames, bg, labels)  # [F]
    out = []
    for t in range(f):
        problems = tuple(name for name, bad in zip(PROBLEMS, (drift[t] > MAX_DRIFT, counts[t] != usual,
                                                              artifacts[t] > MAX_ARTIFACT_FRACTION)) if bad)
        out.append(FrameStability(t, float(drift[t]), int(counts[t]), float(artifacts[t]), problems))
    return StabilityScore(tuple(out), usual)


def artifact_fractions(frames: np.ndarray, bg: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[F] share of each frame's pixels farther than ARTIFACT_DISTANCE from every segment
    bg -> color (alpha clipped to [0, 1]; alpha 0 is the background itself). Pixels that
    ``labels`` gives an object color are explained already (only the rest are measured)."""
    d = frames.astype(np.float32) - bg[:, None, None, :]  # [F, H, W, 3]
    n2 = np.einsum("fhwc,fhwc->fhw", d, d)  # [F, H, W]
    fi, ys, xs = np.nonzero((n2 > ARTIFACT_DISTANCE**2) & (labels < 0))  # far from the background, no color
    per_frame = np.zeros(frames.shape[0])
    if fi.size == 0:
        return per_frame
    p = d[fi, ys, xs]  # [N, 3]
    axes = _PALETTE[None] - bg[:, None, :]  # [F, K, 3] color - background
    axis_n2 = np.maximum((axes * axes).sum(-1), 1.0)[fi]  # [N, K]
    proj = p @ _PALETTE.T - np.einsum("nc,nc->n", p, bg[fi])[:, None]  # [N, K] = p . (color - bg)
    alpha = np.clip(proj / axis_n2, 0.0, 1.0)
    residual = n2[fi, ys, xs][:, None] - 2 * alpha * proj + alpha**2 * axis_n2  # |p - alpha axis|^2
    artifact = residual.min(1) > ARTIFACT_DISTANCE**2
    per_frame += np.bincount(fi[artifact], minlength=frames.shape[0])
    return per_frame / float(frames.shape[1] * frames.shape[2])


def blob_counts(labels: np.ndarray, min_area: float) -> np.ndarray:
    """[F] separated blobs per frame: 4-connected pixels of one palette label, >= min_area each."""
    f, h, w = labels.shape
    flat = labels.reshape(-1)
    pixels = np.flatnonzero(flat >= 0)  # [N] object pixels, flat indices (ascending)
    if pixels.size == 0:
        return np.zeros(f, dtype=np.int64)
    x, y = pixels % w, (pixels // w) % h
    edges = []
    for step, inside in ((1, x < w - 1), (w, y < h - 1)):  # right and down neighbours, same frame
        j = pixels[inside]
        same = flat[j + step] == flat[j]
        edges.append((j[same], j[same] + step))
    # compact indices: union-find over the N object pixels, not the whole video
    compact = np.empty(flat.size, dtype=np.int64)
    compact[pixels] = np.arange(pixels.size)
    a = compact[np.concatenate([e[0] for e in edges])]
    b = compact[np.concatenate([e[1] for e in edges])]
    roots = _union(pixels.size, a, b)  # [N] smallest compact index of each pixel's blob
    blobs, area = np.unique(roots, return_counts=True)  # a blob never spans frames: no edge does
    return np.bincount(pixels[blobs[area >= min_area]] // (h * w), minlength=f).astype(np.int64)


def _union(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Union-find over ``n`` nodes with edges (a, b): hook the larger root of every unequal
    edge onto the smaller, compress paths, repeat until every edge joins equal roots.
    Returns each node's root (the smallest node of its component)."""
    parent = np.arange(n, dtype=np.int64)
    while True:
        ra, rb = parent[a], parent[b]
        differ = ra != rb
        if not differ.any():
            return parent
        np.minimum.at(parent, np.maximum(ra[differ], rb[differ]), np.minimum(ra[differ], rb[differ]))
        while True:  # path compression: every node points at its root
            nxt = parent[parent]
            if np.array_equal(nxt, parent):
                break
            parent = nxt
