"""Prompt adherence of shapes-world videos: does the clip show the color, shape and motion asked for?

Pipeline per clip (all numpy, ~ms per 17x128x128 clip):

1. ``detect(video)``: estimate the background per frame (median of the border), label each
   pixel with the palette color that explains it as ``bg + alpha * (color - bg)`` with
   ``alpha >= 0.5`` and a small off-axis residual (so blur, blending with the background and
   mild noise keep the right color), then per color: track the blob's centroid over frames
   (motion) and match its soft coverage, normalised by its moments, against sharp and
   blurred shape templates (shape; a shapeless blob or a ring is no shape, i.e. a miss).
2. ``evaluate_clip(video, prompt)``: parse the prompt (``shapes_world.parse_prompt``), assign
   prompted objects to detections so that the most attributes agree, and score each
   attribute as correct / wrong / miss (nothing detected) / unknown (not in the prompt).
3. ``evaluate(pairs)``: per-attribute accuracy = correct / (correct + wrong + miss).

Beyond the prompt: ``detect`` also scores every frame's stability (``eval/stability.py``:
background drift from frame 0, separated objects per frame, artifact area, and each
object's silhouette, size and holes against its usual self, and specks), and a clip is
``all_correct`` only when every stated attribute is right *and* no frame fails, so a clip
whose end collapses fails even when its colors, shapes and motions read right. ``count``
(the number of separated objects the clip usually shows vs the number the prompt names) is
scored as a clip attribute, and the report splits one- and two-object prompts
(``by_objects``: count, both colors / shapes / motions right).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from omniloop.eval.shapes_render import coverage_table, render_clip
from omniloop.eval.stability import (
    PROBLEMS,
    ObjectTrack,
    StabilityScore,
    blob_roots,
    score_stability,
    silhouette_geometry,
)
from omniloop.eval.shapes_world import (
    BACKGROUNDS,
    COLORS,
    OBJECT_ATTRIBUTES,
    SHAPES,
    ParsedPrompt,
    held_out_prompts,
    parse_prompt,
)

MIN_SIDE = 32
ATTRIBUTES: tuple[str, ...] = (*OBJECT_ATTRIBUTES, "background", "count")
OUTCOMES: tuple[str, ...] = ("correct", "wrong", "miss", "unknown")

_PALETTE_NAMES = tuple(COLORS)
_PALETTE = np.asarray(list(COLORS.values()), dtype=np.float32)  # [K, 3]
_BG_NAMES = tuple(BACKGROUNDS)
_BG_PALETTE = np.asarray(list(BACKGROUNDS.values()), dtype=np.float32)

# Thresholds, as fractions of min(height, width) unless said otherwise.
_MAX_RESIDUAL = 0.5  # off-axis residual / |color - bg| above which a pixel matches no color
_MIN_AREA = 0.06  # an object covers at least (0.06 * side)^2 pixels in a frame
_MIN_AREA_RATIO = 0.05  # ... and at least this fraction of the largest object's area
_MIN_PRESENCE = 0.5  # ... in at least this fraction of the frames
_STATIC_EXTENT = 0.06  # a track inside a box this size is static
_REVERSAL = 0.1  # a back-and-forth with both legs this long is a bounce
_CIRCLE_SWEEP = 3.5  # radians swept around the track's centre for circling
_TEMPLATE_SIDE = 16
_GRID_REACH = 2.4  # descriptor half-width in radii of gyration (a triangle's apex is at 2.0)
_TEMPLATE_BLURS = (0.0, 0.04, 0.08, 0.12, 0.16)  # template blur sigmas, in shape diameters
_SHAPE_FRAMES = 9  # shape votes from at most this many frames
_MIN_SHAPE_SCORE = 0.65  # template IoU below which a blob is no shape (ground truth scores >= 0.8)
_BLOB = "blob"  # the template class of shapeless smudges
_WINDOW_GROW = 0.25  # coverage window: the blob's bounding box grown by this fraction of its size
_RAMP = (0.2, 0.8)  # coverage ramp: alpha below 0.2 is noise, above 0.8 solid


# --------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Detection:
    """One object found in a clip, identified by its palette color."""

    color: str
    shape: str | None  # None: matches no shape (a blob, a ring)
    motion: str | None  # None: fewer than two frames to tell
    area: float  # median pixels per frame where present
    frames_present: int
    shape_score: float  # mean template IoU of the chosen shape, 0..1


@dataclass(frozen=True, slots=True)
class SceneDetection:
    background: str
    objects: tuple[Detection, ...]  # largest first
    stability: StabilityScore | None = None  # per-frame scores (eval/stability.py)


def _as_video(video) -> np.ndarray:
    arr = np.asarray(video)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[0] < 1:
        raise ValueError(f"video must be uint8 [F, H, W, 3] (or one [H, W, 3] image), got shape {arr.shape}")
    if arr.dtype != np.uint8:
        raise ValueError(f"video must be uint8, got {arr.dtype}; convert with (x * 255).round().clip(0, 255)")
    if min(arr.shape[1:3]) < MIN_SIDE:
        raise ValueError(f"video frames must be at least {MIN_SIDE}x{MIN_SIDE}, got {arr.shape[1]}x{arr.shape[2]}")
    return arr


def _background(frames: np.ndarray) -> np.ndarray:
    """[F, 3] per-frame median of a 2-pixel border ring."""
    f = frames.shape[0]
    ring = np.concatenate([frames[:, :2].reshape(f, -1, 3), frames[:, -2:].reshape(f, -1, 3),
                           frames[:, 2:-2, :2].reshape(f, -1, 3), frames[:, 2:-2, -2:].reshape(f, -1, 3)], axis=1)
    return np.median(ring, axis=1).astype(np.float32)


def _label_pixels(frames: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """[F, H, W] int8: palette index of each object pixel, -1 for background.

    A pixel takes the palette color whose line ``bg + alpha * (color - bg)`` passes closest
    to it (relative to the color's contrast), then counts as object if that color covers
    at least half of it (alpha >= 0.5). Choosing the color before thresholding keeps a
    white object's half-covered rim from passing as a more-than-half-covered yellow.
    """
    d = frames.astype(np.float32)
    d -= bg[:, None, None, :]  # [F, H, W, 3]
    axes = _PALETTE[None] - bg[:, None, :]  # [F, K, 3] color - background
    axis_n2 = np.maximum((axes * axes).sum(-1), 1.0)  # [F, K]
    n2 = np.einsum("fhwc,fhwc->fhw", d, d)  # [F, H, W]; einsum: 3x faster than (d * d).sum(-1)
    labels = np.full(n2.shape, -1, dtype=np.int8)
    fi, ys, xs = np.nonzero(n2 > 0.2 * axis_n2.min(1)[:, None, None])  # alpha >= 0.5 needs |d| >= 0.5 |axis|
    if fi.size == 0:
        return labels
    p = d[fi, ys, xs]  # [N, 3]
    proj = p @ _PALETTE.T - np.einsum("nc,nc->n", p, bg[fi])[:, None]  # [N, K] = p . (color - bg)
    alpha = proj / axis_n2[fi]
    residual = (n2[fi, ys, xs][:, None] - proj * alpha) / axis_n2[fi]  # squared off-axis residual, relative
    cost = np.where(alpha >= 0.25, residual, np.inf)
    best = cost.argmin(1)
    rows = np.arange(best.size)
    ok = (cost[rows, best] <= _MAX_RESIDUAL**2) & (alpha[rows, best] >= 0.5)
    labels[fi[ok], ys[ok], xs[ok]] = best[ok]
    return labels


def _cores(labels: np.ndarray, k: int) -> np.ndarray:
    """[F, H, W] pixels of color k whose 4 neighbours are color k too: an erosion that
    removes the one-pixel rims and speckles that blur and chroma subsampling leave."""
    m = labels == k
    core = np.zeros_like(m)
    core[:, 1:-1, 1:-1] = m[:, 1:-1, 1:-1] & m[:, :-2, 1:-1] & m[:, 2:, 1:-1] & m[:, 1:-1, :-2] & m[:, 1:-1, 2:]
    return core


def _object_pixels(labels: np.ndarray, core: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ys, xs) of color k's blob in one frame: its pixels near the median of its core.

    The anchor is the core pixel nearest that median, so two same-colored blobs far apart
    (a generator's mistake) yield the one nearer the median rather than empty space."""
    cy, cx = np.nonzero(core)
    nearest = int(np.argmin((cy - np.median(cy)) ** 2 + (cx - np.median(cx)) ** 2))
    my, mx = cy[nearest], cx[nearest]
    reach = 2.2 * (math.sqrt(cy.size / math.pi) + 1.5) + 1.0
    ys, xs = np.nonzero(labels == k)
    keep = (ys - my) ** 2 + (xs - mx) ** 2 <= reach * reach
    return ys[keep], xs[keep]


def detect(video) -> SceneDetection:
    """Background and objects (color, shape, motion) of a uint8 [F, H, W, 3] clip."""
    frames = _as_video(video)
    f, h, w, _ = frames.shape
    side = min(h, w)
    bg = _background(frames)
    bg_name = _BG_NAMES[int(np.argmin(((_BG_PALETTE - np.median(bg, axis=0)) ** 2).sum(1)))]
    labels = _label_pixels(frames, bg)  # [F, H, W]
    counts = np.stack([np.bincount(labels[i].ravel() + 1, minlength=len(_PALETTE) + 1)[1:] for i in range(f)])
    min_area = max(4.0, (_MIN_AREA * side) ** 2)
    cores, areas = {}, np.zeros(len(_PALETTE))
    for k in np.nonzero((counts >= min_area).sum(0) >= 1)[0]:
        core = _cores(labels, int(k))
        core_counts = core.sum((1, 2))
        present = core_counts >= min_area / 4  # [F]
        if present.sum() >= max(1, math.ceil(_MIN_PRESENCE * f)):
            cores[k] = (core, present)
            areas[k] = np.median(counts[present, k])
    ranked = [k for k in np.argsort(-areas) if k in cores and areas[k] >= _MIN_AREA_RATIO * areas.max()]
    described = [_describe_blob(frames, bg, labels, *cores[k], k, side) for k in ranked]
    objects = tuple(d for d, _ in described)
    return SceneDetection(bg_name, objects, score_stability(frames, bg, labels, tuple(t for _, t in described)))


def _describe_blob(frames: np.ndarray, bg: np.ndarray, labels: np.ndarray, core: np.ndarray, present: np.ndarray,
                   k: int, side: int) -> tuple[Detection, ObjectTrack]:
    """The object's clip-level verdict (shape voted over <= _SHAPE_FRAMES frames) and its
    frame-by-frame track (silhouette descriptor and coverage of every frame it is present
    in), which the stability check compares with the object's first frames."""
    f = frames.shape[0]
    frames_idx = np.nonzero(present)[0]
    picks = set(np.linspace(0, frames_idx.size - 1, min(_SHAPE_FRAMES, frames_idx.size)).round().astype(int).tolist())
    centroids, areas, descriptors = [], [], []
    per_frame: list[np.ndarray | None] = [None] * f
    masses, solidity, holes = np.zeros(f), np.zeros(f), np.zeros(f, dtype=np.int64)
    for j, i in enumerate(frames_idx):
        ys, xs = _object_pixels(labels[i], core[i], k)
        centroids.append((xs.mean() + 0.5, ys.mean() + 0.5))
        areas.append(ys.size)
        coverage = _coverage_window(frames[i], bg[i], labels[i], k, ys, xs)
        if j in picks:
            descriptors.append(shape_descriptor(coverage))
        # the track reads the object's own blob: a second blob of its color is another
        # object (or a speck) to the stability check, not a change of this one's shape
        by, bx = _main_blob(ys, xs, labels.shape[1:])
        if by.size != ys.size:
            coverage = _coverage_window(frames[i], bg[i], labels[i], k, by, bx)
        per_frame[i] = shape_descriptor(coverage)
        masses[i] = float(coverage.sum())
        solidity[i], holes[i] = silhouette_geometry(by, bx, _half_covered(frames[i], bg[i], k, by, bx))
    shape, score = classify_shape(descriptors)
    motion = classify_motion(frames_idx, np.asarray(centroids), side)
    detection = Detection(_PALETTE_NAMES[k], shape, motion, float(np.median(areas)), int(frames_idx.size), score)
    return detection, ObjectTrack(_PALETTE_NAMES[k], tuple(per_frame), masses, solidity, holes)


# --------------------------------------------------------------------------------------
# Shape: template matching on the soft coverage map, normalised by its moments
# --------------------------------------------------------------------------------------


def _coverage_window(frame: np.ndarray, bg: np.ndarray, labels: np.ndarray, k: int, ys: np.ndarray,
                     xs: np.ndarray) -> np.ndarray:
    """Soft coverage of color k around a blob: [h, w] in [0, 1] over its bounding box grown
    by a quarter of its size (so a soft edge is not cut square).

    alpha = projection on (color - bg); pixels that color k does not explain, or that are
    labeled another color (a neighbour of a similar hue), count 0, and a ramp (_RAMP)
    silences background noise (templates go through the same ramp).
    """
    h, w, _ = frame.shape
    m = 2 + int(_WINDOW_GROW * (max(ys.max() - ys.min(), xs.max() - xs.min()) + 1))
    y0, y1, x0, x1 = max(ys.min() - m, 0), min(ys.max() + m + 1, h), max(xs.min() - m, 0), min(xs.max() + m + 1, w)
    d = frame[y0:y1, x0:x1].astype(np.float32) - bg
    axis = _PALETTE[k] - bg
    axis_n2 = max(float(axis @ axis), 1.0)
    proj = d @ axis
    alpha = proj / axis_n2
    residual = ((d * d).sum(-1) - proj * alpha) / axis_n2
    window_labels = labels[y0:y1, x0:x1]
    explained = (residual <= _MAX_RESIDUAL**2) & ((window_labels == k) | (window_labels < 0))
    return _ramp(np.where(explained, alpha, 0.0))


def _main_blob(ys: np.ndarray, xs: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The largest 4-connected part of the pixels (ys, xs) [N] of an [H, W] frame."""
    keys = np.full((1, *size), -1, dtype=np.int64)
    keys[0, ys, xs] = 0
    roots, pixels = blob_roots(keys)
    ids, counts = np.unique(roots, return_counts=True)
    keep = pixels[roots == ids[counts.argmax()]]
    return keep // size[1], keep % size[1]


def _half_covered(frame: np.ndarray, bg: np.ndarray, k: int, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """[h, w] over the blob's bounding box: pixels whose projection on (color k - bg) is at
    least half the way to color k, whatever their off-axis tint."""
    d = frame[ys.min():ys.max() + 1, xs.min():xs.max() + 1].astype(np.float32) - bg
    axis = _PALETTE[k] - bg
    return d @ axis >= 0.5 * max(float(axis @ axis), 1.0)


def _ramp(alpha: np.ndarray) -> np.ndarray:
    lo, hi = _RAMP
    return np.clip((alpha - lo) / (hi - lo), 0.0, 1.0).astype(np.float32)


def shape_descriptor(coverage: np.ndarray) -> np.ndarray | None:
    """[T, T] coverage resampled around its centroid, in units of its radius of gyration:
    invariant to position and scale, and barely moved by stray edge pixels (unlike a bbox)."""
    m0 = float(coverage.sum())
    if m0 < 4.0:
        return None
    yy, xx = np.indices(coverage.shape, dtype=np.float32)
    cy, cx = float((coverage * yy).sum()) / m0, float((coverage * xx).sum()) / m0
    g = math.sqrt(float((coverage * ((yy - cy) ** 2 + (xx - cx) ** 2)).sum()) / m0)
    grid = np.linspace(-_GRID_REACH, _GRID_REACH, _TEMPLATE_SIDE, dtype=np.float32) * max(g, 0.5)
    return _bilinear(coverage, cy + grid[:, None], cx + grid[None, :])


def _bilinear(img: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sample img at fractional pixel coordinates (pixel centres at integers), 0 outside."""
    padded = np.pad(img, 1)
    y, x = np.broadcast_arrays(y + 1, x + 1)
    y0 = np.clip(np.floor(y).astype(np.int64), 0, padded.shape[0] - 2)
    x0 = np.clip(np.floor(x).astype(np.int64), 0, padded.shape[1] - 2)
    fy, fx = np.clip(y - y0, 0, 1), np.clip(x - x0, 0, 1)
    top = padded[y0, x0] * (1 - fx) + padded[y0, x0 + 1] * fx
    bottom = padded[y0 + 1, x0] * (1 - fx) + padded[y0 + 1, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    if sigma <= 0:
        return img
    r = int(math.ceil(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    padded = np.pad(img, r)
    rows = np.apply_along_axis(np.convolve, 1, padded, k, mode="valid")
    return np.apply_along_axis(np.convolve, 0, rows, k, mode="valid")


@lru_cache(maxsize=1)
def shape_templates() -> tuple[tuple[str, ...], np.ndarray]:
    """(shape per template, [V, T, T] descriptors): each shape sharp and blurred (a blurry
    generated shape loses its corners, so it is compared with templates that lost them too),
    plus Gaussian blobs named ``_BLOB``: a shapeless smudge must not pass for a shape."""
    diameter = 64
    names, descriptors = [], []
    for shape in SHAPES:
        coverage = np.pad(coverage_table(shape, 2 * diameter)[0, 0], diameter // 2)
        for sigma in _TEMPLATE_BLURS:
            names.append(shape)
            descriptors.append(shape_descriptor(_ramp(_blur(coverage, sigma * diameter))))
    yy, xx = np.indices((2 * diameter, 2 * diameter)) - diameter + 0.5
    blob = np.exp(-(yy**2 + xx**2) / (2 * (diameter / 4) ** 2)).astype(np.float32)
    for peak in (1.0, 0.7):  # after the ramp, a Gaussian's look depends on its peak, not its width
        names.append(_BLOB)
        descriptors.append(shape_descriptor(_ramp(peak * blob)))
    return tuple(names), np.stack(descriptors)


def classify_shape(descriptors: list[np.ndarray | None]) -> tuple[str | None, float]:
    """Vote over frames: the shape whose best template has the highest mean soft IoU.

    None (a miss, never a lucky guess) when the blob matches a shapeless Gaussian best or
    no template well (< _MIN_SHAPE_SCORE, e.g. a ring or a long ellipse)."""
    names, templates = shape_templates()
    valid: list[np.ndarray] = [d for d in descriptors if d is not None]
    if not valid:
        return None, 0.0
    obs = np.stack(valid)[:, None]  # [N, 1, T, T]
    iou = np.minimum(obs, templates).sum((2, 3)) / np.maximum(np.maximum(obs, templates).sum((2, 3)), 1e-6)
    per_shape = {s: float(iou[:, [i for i, n in enumerate(names) if n == s]].max(1).mean())
                 for s in (*SHAPES, _BLOB)}
    best = max(per_shape, key=per_shape.__getitem__)
    if best == _BLOB or per_shape[best] < _MIN_SHAPE_SCORE:
        return None, per_shape[best]
    return best, per_shape[best]


# --------------------------------------------------------------------------------------
# Motion: the centroid track
# --------------------------------------------------------------------------------------


def _reversal(p: np.ndarray) -> float:
    """Longest back-and-forth: max over j of min(rise into j, fall after j), for peaks and valleys."""
    best = 0.0
    for q in (p, -p):
        rise = q - np.minimum.accumulate(q)
        fall = q - np.minimum.accumulate(q[::-1])[::-1]
        best = max(best, float(np.minimum(rise, fall).max()))
    return best


def _is_circling(p: np.ndarray) -> bool:
    ext = p.max(0) - p.min(0)
    if ext.min() < 0.35 * ext.max():
        return False  # one-dimensional
    v = p - (p.max(0) + p.min(0)) / 2
    steps = np.diff(np.unwrap(np.arctan2(v[:, 1], v[:, 0])))
    sweep = abs(float(steps.sum()))
    return sweep >= _CIRCLE_SWEEP and float(np.abs(steps).max()) <= 0.6 * sweep


def classify_motion(frame_idx: np.ndarray, centroids: np.ndarray, side: int) -> str | None:
    """static / circling / bouncing / right / left / up / down from [T, 2] (x, y) centroids."""
    if len(centroids) < 2:
        return None
    p = centroids / side
    if (p.max(0) - p.min(0)).max() < _STATIC_EXTENT:
        return "static"
    if _is_circling(p):
        return "circling"
    if max(_reversal(p[:, 0]), _reversal(p[:, 1])) >= _REVERSAL:
        return "bouncing"
    t = np.asarray(frame_idx, dtype=np.float64)
    slope = np.polyfit(t - t.mean(), p, 1)[0] * (t[-1] - t[0])  # net displacement of the fitted line
    if abs(slope[0]) >= abs(slope[1]):
        return "right" if slope[0] > 0 else "left"
    return "down" if slope[1] > 0 else "up"


# --------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttributeScore:
    attribute: str
    object: int | None  # index into the prompt's objects; None for the background
    expected: str | None
    predicted: str | None
    outcome: str  # one of OUTCOMES


@dataclass(frozen=True, slots=True)
class ClipScore:
    prompt: str
    parsed: ParsedPrompt
    detection: SceneDetection
    scores: tuple[AttributeScore, ...]

    @property
    def prompt_correct(self) -> bool:
        """Every attribute the prompt states is right (and at least one is stated)."""
        known = [s for s in self.scores if s.outcome != "unknown"]
        return bool(known) and all(s.outcome == "correct" for s in known)

    @property
    def stable(self) -> bool:
        """No frame fails the stability scores (background drift, object count, artifacts,
        an object's shape and size, specks)."""
        return self.detection.stability is None or self.detection.stability.stable

    @property
    def all_correct(self) -> bool:
        """The verdict: the prompt is shown (every stated attribute right) to the last frame."""
        return self.prompt_correct and self.stable

    def outcome(self, attribute: str, obj: int | None = 0) -> str:
        return next(s.outcome for s in self.scores if s.attribute == attribute and s.object == obj)

    def to_dict(self) -> dict:
        stability = self.detection.stability
        return {"prompt": self.prompt, "all_correct": self.all_correct, "prompt_correct": self.prompt_correct,
                "stable": self.stable, "detected": [asdict(d) for d in self.detection.objects],
                "background": self.detection.background, "scores": [asdict(s) for s in self.scores],
                "stability": None if stability is None else {**stability.to_dict(), "why": stability.explain()}}


def _outcome(expected: str | None, predicted: str | None) -> str:
    if expected is None:
        return "unknown"
    if predicted is None:
        return "miss"
    return "correct" if predicted == expected else "wrong"


def _assign(parsed: ParsedPrompt, found: tuple[Detection, ...]) -> tuple[Detection | None, ...]:
    """Prompted object -> detection (or None), maximising agreeing attributes.

    Only the n+1 largest detections compete (n prompted objects), so scattering every
    color over the frame does not buy adherence; ties go to larger detections.
    """
    objs = parsed.objects
    pool = list(found[: len(objs) + 1]) + [None] * len(objs)
    best: tuple[Detection | None, ...] = (None,) * len(objs)
    best_key = None
    for choice in itertools.permutations(range(len(pool)), len(objs)):
        picked = tuple(pool[c] for c in choice)
        agree = sum(d is not None and o.get(a) is not None and getattr(d, a) == o.get(a)
                    for o, d in zip(objs, picked) for a in OBJECT_ATTRIBUTES)
        key = (agree, sum(d is not None for d in picked), -sum(choice))
        if best_key is None or key > best_key:
            best, best_key = picked, key
    return best


def evaluate_clip(video, prompt: str) -> ClipScore:
    """Score one clip against its prompt. Never raises on prompt content; raises ValueError
    for a malformed video."""
    parsed = parse_prompt(prompt)
    detection = detect(video)
    scores = []
    for i, (obj, det) in enumerate(zip(parsed.objects, _assign(parsed, detection.objects))):
        for a in OBJECT_ATTRIBUTES:
            predicted = getattr(det, a) if det is not None else None
            scores.append(AttributeScore(a, i, obj.get(a), predicted, _outcome(obj.get(a), predicted)))
    scores.append(AttributeScore("background", None, parsed.background, detection.background,
                                 _outcome(parsed.background, detection.background)))
    expected = _expected_count(parsed)
    seen = None if detection.stability is None else str(detection.stability.usual_objects)
    scores.append(AttributeScore("count", None, expected, seen, _outcome(expected, seen)))
    return ClipScore(prompt, parsed, detection, tuple(scores))


def _expected_count(parsed: ParsedPrompt) -> str | None:
    """How many objects the prompt names ("1", "2"), when each has a color or a shape."""
    named = all(o.color is not None or o.shape is not None for o in parsed.objects)
    return str(len(parsed.objects)) if named else None


@dataclass(slots=True)
class AdherenceReport:
    """Per-attribute accuracy over a set of clips; JSON-serialisable through ``to_dict``."""

    n_clips: int
    n_objects: int
    # attribute -> {"accuracy": float | None, "correct": n, "wrong": n, "miss": n, "unknown": n, "scored": n}
    attributes: dict[str, dict]
    # attribute -> expected -> predicted ("none" for a miss) -> count, over scored attributes
    confusion: dict[str, dict[str, dict[str, int]]]
    clip_accuracy: float | None  # clips whose every stated attribute is right and every frame stable
    failures: list[dict] = field(default_factory=list)  # the first few clips with an error
    prompt_accuracy: float | None = None  # clips whose every stated attribute is right (stability aside)
    # {"stable": fraction, "problems": {kind: clips}, "per_frame": [{frame, clips, failing, drift, ...}]}
    stability: dict = field(default_factory=dict)
    # prompted objects ("1", "2") -> {"clips", "count", "color_all", "shape_all", "motion_all", ...}
    by_objects: dict = field(default_factory=dict)

    def accuracy(self, attribute: str) -> float | None:
        return self.attributes[attribute]["accuracy"]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def summarize(clips: Iterable[ClipScore], *, max_failures: int = 20) -> AdherenceReport:
    counts = {a: dict.fromkeys(OUTCOMES, 0) for a in ATTRIBUTES}
    confusion: dict[str, dict[str, dict[str, int]]] = {a: {} for a in ATTRIBUTES}
    n_clips = n_objects = n_all = n_prompt = n_stated = 0
    failures: list[dict] = []  # ClipScore.to_dict() of the first few clips with an error
    stabilities: list[StabilityScore] = []
    groups: dict[str, list[ClipScore]] = {}
    for clip in clips:
        n_clips += 1
        n_objects += len(clip.parsed.objects)
        if clip.detection.stability is not None:
            stabilities.append(clip.detection.stability)
        groups.setdefault(str(len(clip.parsed.objects)), []).append(clip)
        for s in clip.scores:
            counts[s.attribute][s.outcome] += 1
            if s.outcome != "unknown":  # (_outcome: "unknown" exactly when nothing was expected)
                assert s.expected is not None, f"{s.attribute} scored {s.outcome!r} against no expected value"
                row = confusion[s.attribute].setdefault(s.expected, {})
                key = "none" if s.outcome == "miss" or s.predicted is None else s.predicted  # a miss predicted nothing
                row[key] = row.get(key, 0) + 1
        if any(s.outcome != "unknown" for s in clip.scores):
            n_stated += 1
            n_all += clip.all_correct
            n_prompt += clip.prompt_correct
            if not clip.all_correct and len(failures) < max_failures:
                failures.append(clip.to_dict())
    attributes = {}
    for a, c in counts.items():
        scored = c["correct"] + c["wrong"] + c["miss"]
        attributes[a] = {"accuracy": c["correct"] / scored if scored else None, **c, "scored": scored}
    rate = (lambda n: n / n_stated if n_stated else None)
    return AdherenceReport(n_clips, n_objects, attributes, confusion, rate(n_all), failures, rate(n_prompt),
                           stability_summary(stabilities), {k: _group_summary(v) for k, v in sorted(groups.items())})


def _group_summary(clips: list[ClipScore]) -> dict:
    """Over clips that prompt the same number of objects: count accuracy, and the share of
    clips whose every prompted object has its stated color / shape / motion right."""
    out: dict = {"clips": len(clips)}
    for a in (*OBJECT_ATTRIBUTES, "count"):
        stated = [c for c in clips if any(s.attribute == a and s.outcome != "unknown" for s in c.scores)]
        right = [c for c in stated if all(s.outcome in ("correct", "unknown") for s in c.scores if s.attribute == a)]
        out[a if a == "count" else f"{a}_all"] = len(right) / len(stated) if stated else None
    for verdict in ("prompt_correct", "stable", "all_correct"):
        out[verdict] = sum(getattr(c, verdict) for c in clips) / len(clips)
    return out


def stability_summary(scores: list[StabilityScore]) -> dict:
    """Stable share, clips per problem kind, and per frame index (over the clips that long):
    the failing share, mean background drift, mean artifact share, off-count share and the
    shares failing on an object's shape, its size and specks."""
    if not scores:
        return {}
    longest = max(len(s.frames) for s in scores)
    per_frame = []
    for t in range(longest):
        frames = [(s.frames[t], s.usual_objects) for s in scores if len(s.frames) > t]
        per_frame.append({
            "frame": t, "clips": len(frames),
            "failing": round(sum(bool(f.problems) for f, _ in frames) / len(frames), 4),
            "drift": round(float(np.mean([f.background_drift for f, _ in frames])), 2),
            "artifact_fraction": round(float(np.mean([f.artifact_fraction for f, _ in frames])), 5),
            "objects_off": round(sum(f.objects != usual for f, usual in frames) / len(frames), 4),
            **{f"{kind}_off": round(sum(kind in f.problems for f, _ in frames) / len(frames), 4)
               for kind in ("shape", "size", "specks")},
        })
    problems = {kind: sum(any(kind in f.problems for f in s.frames) for s in scores) for kind in PROBLEMS}
    return {"clips": len(scores), "stable": sum(s.stable for s in scores) / len(scores), "problems": problems,
            "worst_frame": max(per_frame, key=lambda r: (r["failing"], r["drift"]))["frame"], "per_frame": per_frame}


def evaluate(pairs: Iterable[tuple[np.ndarray, str]], **kwargs) -> AdherenceReport:
    """Score (video, prompt) pairs; videos may be loaded lazily by the iterable."""
    return summarize((evaluate_clip(video, prompt) for video, prompt in pairs), **kwargs)


# --------------------------------------------------------------------------------------
# Inputs: files on disk, or rendered ground truth (a self-check)
# --------------------------------------------------------------------------------------


def _video_paths(pattern: str) -> list[Path]:
    path = Path(pattern)
    if path.is_dir():
        return sorted(path.glob("*.mp4"))
    if path.is_file():
        return [path]
    anchor = Path(path.anchor or ".")
    return sorted(anchor.glob(str(path.relative_to(anchor)) if path.is_absolute() else pattern))


def _read_prompts(jsonl: Path) -> dict[Path, str]:
    out = {}
    for n, line in enumerate(jsonl.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            video, prompt = row["video"], row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f'{jsonl}:{n}: expected a JSON object {{"video": path, "prompt": text}}') from None
        out[(jsonl.parent / video).resolve()] = str(prompt)
    return out


def file_pairs(videos: str | None, prompts: str | Path | None = None) -> list[tuple[Path, str]]:
    """(mp4 path, prompt) pairs: the videos matching ``videos`` (a directory, file or glob),
    prompts from a JSONL of {"video", "prompt"} (paths relative to the JSONL), else from a
    sidecar ``<stem>.txt``, else from the mp4's title tag (where ``omniloop generate`` writes
    its prompt). With only ``prompts``, every video listed there."""
    from omniloop.io.video import mp4_title

    table = _read_prompts(Path(prompts)) if prompts else {}
    paths = _video_paths(videos) if videos else list(table)
    if not paths:
        raise ValueError(f"no videos match {videos!r}; pass a directory of .mp4 files, a file or a glob")
    pairs, missing = [], []
    for path in paths:
        prompt = table.get(path.resolve())
        sidecar = path.with_suffix(".txt")
        if prompt is None and sidecar.is_file():
            prompt = sidecar.read_text().strip()
        if prompt is None:
            prompt = mp4_title(path)
        if prompt is None:
            missing.append(str(path))
        else:
            pairs.append((path, prompt))
    if missing:
        raise ValueError(f"no prompt for {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         f"list them in --prompts FILE.jsonl or write a .txt next to each video (a clip "
                         f"omniloop generate wrote carries its prompt)")
    return pairs


def load_pairs(pairs: Iterable[tuple[Path, str]]) -> Iterator[tuple[np.ndarray, str]]:
    from omniloop.io.video import read_video

    for path, prompt in pairs:
        yield read_video(path)[0], prompt


def ground_truth_pairs(n: int, *, seed: int = 0, height: int = 128, width: int = 128, num_frames: int = 17,
                       h264: bool = False) -> Iterator[tuple[np.ndarray, str]]:
    """Rendered held-out clips and their prompts, optionally through an H.264 round trip."""
    for item in held_out_prompts(n, seed):
        video = render_clip(item.scene, height, width, num_frames)
        if h264:
            from omniloop.io.video import encode_mp4, read_video

            video = read_video(encode_mp4(video, fps=8))[0]
        yield video, item.prompt
