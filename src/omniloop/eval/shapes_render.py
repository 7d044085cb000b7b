"""Rendering shapes-world scenes to uint8 clips: anti-aliased, deterministic, a few ms per clip.

Shared by the training data (``omniloop.train.data.shapes``), the evaluator's shape
templates and its ground-truth self-check, hence outside ``train/``.

Anti-aliasing: each (shape, diameter) gets a coverage table once (LRU-cached): the shape
is point-sampled on a grid ``_SS`` times finer than the pixels, and box-filtered at each
of the ``_SS x _SS`` sub-pixel phases. Rendering a frame is then a table lookup and one
alpha blend per object window, so a 17x128x128 clip costs about a millisecond.
Positions are quantized to 1/_SS px and diameters to 1/2 px.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from omniloop.eval.shapes_world import BACKGROUNDS, COLORS, ObjectSpec, Scene

_SS = 4  # supersampling factor per axis (16 samples per pixel, 1/4 px positions)


def _star_polygon(points: int = 5, inner: float = 0.5) -> np.ndarray:
    angles = -math.pi / 2 + np.arange(2 * points) * math.pi / points
    radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


_TRIANGLE = np.array([[0.0, -0.866], [1.0, 0.866], [-1.0, 0.866]])  # equilateral, side 2, apex up
_STAR = _star_polygon()


def _inside_polygon(x: np.ndarray, y: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """Even-odd rule, vectorized over points."""
    inside = np.zeros(x.shape, dtype=bool)
    for (x0, y0), (x1, y1) in zip(poly, np.roll(poly, -1, axis=0)):
        crosses = (y0 > y) != (y1 > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            xi = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (x < xi)
    return inside


def inside_shape(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Point membership in unit coordinates: every shape fits in [-1, 1]^2, y points down."""
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "square":
        return np.maximum(np.abs(x), np.abs(y)) <= 0.88
    if shape == "triangle":
        return _inside_polygon(x, y, _TRIANGLE)
    if shape == "star":
        return _inside_polygon(x, y, _STAR)
    if shape == "cross":
        ax, ay = np.abs(x), np.abs(y)
        return ((ax <= 0.34) & (ay <= 0.95)) | ((ay <= 0.34) & (ax <= 0.95))
    raise ValueError(f"unknown shape {shape!r}")


@lru_cache(maxsize=2048)
def coverage_table(shape: str, diameter_halfpx: int) -> np.ndarray:
    """[_SS, _SS, n, n] float32 coverage of an n x n window, per sub-pixel phase (qy, qx).

    At phase (qy, qx) the shape's centre sits at (n//2 + qy/_SS, n//2 + qx/_SS) in window
    pixels (pixel i spans [i, i+1)). ``diameter_halfpx`` is the diameter in half pixels.
    """
    radius = diameter_halfpx / 4.0
    n = 2 * math.ceil(radius + 1)
    # samples one pixel beyond the window on the low side, so every phase is a slice
    coords = (np.arange((n + 1) * _SS) + 0.5) / _SS - n // 2 - 1  # relative to the centre at phase 0
    y, x = np.meshgrid(coords / radius, coords / radius, indexing="ij")
    fine = inside_shape(shape, x, y).astype(np.float32)
    table = np.empty((_SS, _SS, n, n), dtype=np.float32)
    for qy in range(_SS):
        for qx in range(_SS):
            patch = fine[_SS - qy:_SS - qy + n * _SS, _SS - qx:_SS - qx + n * _SS]
            table[qy, qx] = patch.reshape(n, _SS, n, _SS).mean(axis=(1, 3))
    table.setflags(write=False)
    return table


def object_centers_px(obj: ObjectSpec, height: int, width: int, num_frames: int) -> tuple[np.ndarray, float]:
    """Pixel centres [F, 2] (x, y; pixel i spans [i, i+1)) and the diameter in pixels."""
    diameter = round(obj.diameter * min(height, width) * 2) / 2
    spans = np.array([width, height], dtype=np.float64) - diameter  # free region in pixels
    uv = obj.path(num_frames)
    if obj.motion == "circling":
        # a circle in pixels on any aspect: the radius is in units of the shorter span
        center = np.asarray(obj.center, dtype=np.float64)
        return diameter / 2 + center * spans + (uv - center) * spans.min(), diameter
    return diameter / 2 + uv * spans, diameter


def _draw_object(frames: np.ndarray, obj: ObjectSpec) -> None:
    f, h, w, _ = frames.shape
    xy, diameter = object_centers_px(obj, h, w, f)
    draw_path(frames, obj.shape, obj.color, xy, diameter)


def draw_path(frames: np.ndarray, shape: str, color_name: str, xy: np.ndarray, diameter: float) -> None:
    """Draw one object into ``frames`` [F, H, W, 3] (in place) at pixel centres ``xy`` [F, 2]."""
    f, h, w, _ = frames.shape
    table = coverage_table(shape, int(round(diameter * 2)))
    n = table.shape[-1]
    color = np.asarray(COLORS[color_name], dtype=np.float32)
    q = np.round(xy * _SS).astype(np.int64)  # quantized centre in 1/_SS px
    whole, phase = np.divmod(q, _SS)
    origin = whole - n // 2  # window origin (x0, y0) per frame
    for i in range(f):
        x0, y0 = int(origin[i, 0]), int(origin[i, 1])
        alpha = table[phase[i, 1], phase[i, 0]]
        # clip the window to the frame (only zero coverage lies outside)
        ys, xs = slice(max(y0, 0), min(y0 + n, h)), slice(max(x0, 0), min(x0 + n, w))
        a = alpha[ys.start - y0:ys.stop - y0, xs.start - x0:xs.stop - x0, None]
        region = frames[i, ys, xs].astype(np.float32)
        frames[i, ys, xs] = (region + a * (color - region) + 0.5).astype(np.uint8)


def render_clip(scene: Scene, height: int = 128, width: int = 128, num_frames: int = 17) -> np.ndarray:
    """The scene as a clip: [F, H, W, 3] uint8. Pure function of its arguments."""
    if height < 16 or width < 16 or num_frames < 1:
        raise ValueError(f"need height, width >= 16 and num_frames >= 1, got {height}x{width}x{num_frames}")
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    # NOTE: filling from one [W, 3] row is ~40x faster than broadcasting a 3-vector
    frames[:] = np.tile(np.asarray(BACKGROUNDS[scene.background], dtype=np.uint8), (width, 1))
    for obj in scene.objects:  # later objects are drawn on top
        _draw_object(frames, obj)
    return frames
