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

Those three are blind to an object that breaks while staying one blob of its color (issue
30: "a large white cross bouncing on a navy background" from the shipped student ends in a
blob with a hole and a yellow speck, and scored 100%: the speck was below ``min_area`` and of
a palette color, the blob one object). So each detected object is also tracked frame by
frame (``ObjectTrack``, from ``adherence.detect``) and held to its usual self, the median
over the clip's frames (the world's objects never change shape or size):

* ``shape``: its silhouette (``adherence.shape_descriptor``: centred, scaled by the radius
  of gyration) has soft IoU < MIN_SILHOUETTE with its usual one, or its solidity (area /
  convex hull) moved by > MAX_SOLIDITY_CHANGE (a cross or star melting into a blob fills
  in), or it encloses a see-through hole of >= HOLE_FRACTION of the frame;
* ``size``: its coverage (alpha-weighted pixels) is > MAX_SIZE_CHANGE times or < 1 /
  MAX_SIZE_CHANGE of its usual one (shrinking, swelling, fading; gone is inf);
* ``specks``: blobs that hold a 3 x 3 square of pixels off the clip's own palette (the
  background and its objects' colors) or of palette-colored crumbs smaller than an object.

A frame fails when any score is past its threshold; a clip is stable when no frame fails.
Thresholds were set on ground truth (clean, H.264 round trip, blurred + noisy: every frame
passes with a wide margin, tests/eval/test_stability.py: drift <= 0.2, artifacts <= 0.05%)
against the session-5 models: frames 0-8 of 16 student videos drift <= 7.1 with <= 0.05%
artifacts, their frames 13-16 drift 18-169 (every clip), and the VAE's own round trip of
ground truth drifts 18-142 there with up to 93% artifacts. The shape, size and speck
thresholds: on 280 clean clips (every color, shape and motion; backgrounds cycling) the
worst frame has silhouette IoU 0.92, size x1.03, solidity change 0.07, no hole, no speck; on
300 held-out clips (128 px), 300 training clips (64 px), 300 blurred + noisy ones (64 px)
and 60 H.264 round trips IoU >= 0.84, size <= x1.07, solidity change <= 0.10, no hole, no
speck (1,240 clean clips, none fails); the student's broken frames (looked at
in contact sheets) score IoU 0.45-0.7, holes of 16-49 px, specks of 3 x 3 px and up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniloop.eval.shapes_world import COLORS

MAX_DRIFT = 15.0  # RGB distance of a frame's background from frame 0's
ARTIFACT_DISTANCE = 40.0  # RGB distance from every background -> color segment that makes a pixel an artifact
MAX_ARTIFACT_FRACTION = 0.01  # of a frame's pixels
_MIN_AREA = 0.06  # a counted blob covers at least (0.06 * side)^2 pixels (adherence's object threshold)

MIN_SILHOUETTE = 0.7  # soft IoU of an object's silhouette with its usual one (ground truth >= 0.8)
MAX_SIZE_CHANGE = 1.6  # an object's coverage may grow or shrink by this factor from its usual one
MAX_SOLIDITY_CHANGE = 0.12  # area / convex hull area: a melting cross or star fills in (cross 0.75, blob ~0.95)
HOLE_FRACTION = 0.0007  # of the frame's pixels (11 at 128 x 128): an object with a hole this big has lost its shape
MIN_HOLE = 4  # pixels: the hole threshold's floor on small frames

_PALETTE = np.asarray(list(COLORS.values()), dtype=np.float32)  # [K, 3]
_PALETTE_NAMES = tuple(COLORS)
PROBLEMS = ("background", "objects", "artifacts", "shape", "size", "specks")


@dataclass(frozen=True, slots=True)
class ObjectTrack:
    """One detected object frame by frame, as ``adherence.detect`` reads it: its palette
    color, its silhouette per frame (``adherence.shape_descriptor``: [T, T] coverage around
    the centroid in units of the radius of gyration, so position and scale drop out; None
    where absent) and its coverage per frame (alpha-weighted pixels, 0 where absent)."""

    color: str
    descriptors: tuple[np.ndarray | None, ...]  # [F]
    masses: np.ndarray  # [F]
    solidity: np.ndarray  # [F] area / convex hull area of its labeled pixels (silhouette_geometry), 0 where absent
    holes: np.ndarray  # [F] pixels of the largest hole it encloses


@dataclass(frozen=True, slots=True)
class FrameStability:
    index: int
    background_drift: float  # RGB distance from frame 0's background
    objects: int  # separated palette-colored blobs
    artifact_fraction: float  # 0..1
    problems: tuple[str, ...]  # the scores past their thresholds (of PROBLEMS)
    silhouette: float = 1.0  # worst object's silhouette IoU with its usual one (1: no object)
    size_change: float = 1.0  # worst object's coverage ratio to its usual one (>= 1, either way)
    solidity_change: float = 0.0  # worst object's |solidity - its usual one|
    hole: int = 0  # pixels of the largest hole in an object
    specks: int = 0  # small off-palette or detached blobs


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
        return "; ".join(f"frame {f.index}: {', '.join(f.problems)} ({self._why(f)})" for f in bad)

    def _why(self, f: FrameStability) -> str:
        """The failing scores of one frame, with what they are compared with."""
        why = {"background": f"drift {f.background_drift:.0f}",
               "objects": f"{f.objects} objects vs {self.usual_objects}",
               "artifacts": f"artifacts {100 * f.artifact_fraction:.1f}%",
               "shape": f"silhouette IoU {f.silhouette:.2f} with the usual one, solidity change "
                        f"{f.solidity_change:.2f}, hole {f.hole} px",
               "size": f"size x{f.size_change:.2f} of the usual one",
               "specks": f"{f.specks} specks"}
        return ", ".join(why[p] for p in f.problems)

    def to_dict(self) -> dict:
        return {"stable": self.stable, "failing_frames": list(self.failing_frames),
                "usual_objects": self.usual_objects,
                "background_drift": [round(f.background_drift, 1) for f in self.frames],
                "objects": [f.objects for f in self.frames],
                "artifact_fraction": [round(f.artifact_fraction, 4) for f in self.frames],
                "silhouette": [round(f.silhouette, 3) for f in self.frames],
                "size_change": [round(f.size_change, 3) if np.isfinite(f.size_change) else None for f in self.frames],
                "solidity_change": [round(f.solidity_change, 3) for f in self.frames],
                "hole": [f.hole for f in self.frames],
                "specks": [f.specks for f in self.frames]}


def score_stability(frames: np.ndarray, bg: np.ndarray, labels: np.ndarray,
                    tracks: tuple[ObjectTrack, ...] = ()) -> StabilityScore:
    """Per-frame stability of uint8 ``frames`` [F, H, W, 3], given their per-frame
    background ``bg`` [F, 3], palette ``labels`` [F, H, W] (-1: no object color) and the
    detected objects' ``tracks``, as ``adherence.detect`` computes them."""
    f, h, w, _ = frames.shape
    drift = np.sqrt(((bg - bg[:1]) ** 2).sum(-1))  # [F]
    min_area = max(4.0, (_MIN_AREA * min(h, w)) ** 2)
    specks = speck_counts(frames, bg, labels, tracks, min_area)  # [F], read at full resolution
    changes = track_changes(tracks, f)
    max_hole = max(MIN_HOLE, HOLE_FRACTION * h * w)
    # NOTE: areas are read on every second row and column from 64 px up (a quarter of the
    # pixels, ~4x faster; blobs and artifact shares are areas, which this estimates)
    stride = 2 if min(h, w) >= 64 else 1
    frames, labels = frames[:, ::stride, ::stride], labels[:, ::stride, ::stride]
    counts = blob_counts(labels, min_area / stride**2)  # [F]
    usual = int(np.bincount(counts).argmax())
    artifacts = artifact_fractions(frames, bg, labels)  # [F]
    out = []
    for t in range(f):
        bad = (drift[t] > MAX_DRIFT, counts[t] != usual, artifacts[t] > MAX_ARTIFACT_FRACTION,
               changes.silhouette[t] < MIN_SILHOUETTE or changes.solidity_change[t] > MAX_SOLIDITY_CHANGE
               or changes.hole[t] >= max_hole, changes.size_change[t] > MAX_SIZE_CHANGE, specks[t] > 0)
        problems = tuple(name for name, b in zip(PROBLEMS, bad) if b)
        out.append(FrameStability(t, float(drift[t]), int(counts[t]), float(artifacts[t]), problems,
                                  float(changes.silhouette[t]), float(changes.size_change[t]),
                                  float(changes.solidity_change[t]), int(changes.hole[t]), int(specks[t])))
    return StabilityScore(tuple(out), usual)


@dataclass(frozen=True, slots=True)
class _TrackChanges:
    """Per frame [F], the worst over the tracked objects of each shape score."""

    silhouette: np.ndarray  # IoU with the reference silhouette (0: the object is gone)
    size_change: np.ndarray  # coverage ratio to the reference's, >= 1 either way (inf: gone)
    solidity_change: np.ndarray  # |solidity - the reference's|
    hole: np.ndarray  # pixels of the largest hole


def track_changes(tracks: tuple[ObjectTrack, ...], f: int) -> _TrackChanges:
    """Each tracked object's frames against its usual self: the per-pixel median of its
    descriptors, and the median coverage and solidity, over the frames where it is present.
    The world's objects never change shape or size and have no holes, so a melting,
    morphing, shrinking or fading object drifts from its usual self while a moving one does
    not (the descriptor is centred and scaled). The median over the whole clip, not its
    first frames: a clip that starts malformed and settles (two objects glued together,
    then apart) names its first frames, and one that breaks down late its last ones."""
    out = _TrackChanges(np.ones(f), np.ones(f), np.zeros(f), np.zeros(f, dtype=np.int64))
    for track in tracks:
        present = [t for t, d in enumerate(track.descriptors) if d is not None and track.masses[t] > 0]
        if not present:
            continue
        present_descriptors = [d for t in present if (d := track.descriptors[t]) is not None]  # all of them
        reference = np.median(np.stack(present_descriptors), axis=0)  # [T, T]
        ref_mass, ref_solidity = float(np.median(track.masses[present])), float(np.median(track.solidity[present]))
        for t in range(f):
            d = track.descriptors[t]
            if d is None or track.masses[t] <= 0:
                out.silhouette[t], out.size_change[t] = 0.0, np.inf
                continue
            iou = float(np.minimum(d, reference).sum() / max(float(np.maximum(d, reference).sum()), 1e-6))
            ratio = track.masses[t] / ref_mass
            out.silhouette[t] = min(out.silhouette[t], iou)
            out.size_change[t] = max(out.size_change[t], ratio, 1.0 / ratio)
            out.solidity_change[t] = max(out.solidity_change[t], abs(track.solidity[t] - ref_solidity))
            out.hole[t] = max(out.hole[t], track.holes[t])
    return out


def speck_counts(frames: np.ndarray, bg: np.ndarray, labels: np.ndarray, tracks: tuple[ObjectTrack, ...],
                 min_area: float) -> np.ndarray:
    """[F] specks per frame: 4-connected blobs that hold a 3 x 3 square (so the one- or
    two-pixel rims that blur or H.264's chroma subsampling leave along an edge, even where
    they wrap a star's tip, are none), made of pixels that are either

    * off the clip's palette: farther than ARTIFACT_DISTANCE from the background and from
      every segment background -> tracked object color (a yellow speck on a white cross),
    * or labeled a palette color but outside every blob of at least ``min_area`` pixels
      (a detached crumb; a larger one is an extra object, ``objects`` counts it).

    Without tracked objects there is no palette to hold a frame to: 0 specks."""
    f, h, w, _ = frames.shape
    if not tracks:
        return np.zeros(f, dtype=np.int64)
    colors = np.asarray([COLORS[t.color] for t in tracks], dtype=np.float32)  # [K, 3]
    off = _off_palette(frames, bg, colors)  # [F, H, W]
    labeled = labels >= 0
    big = _blob_areas(np.where(labeled, labels, -1).astype(np.int64)) >= min_area  # [F, H, W]
    crumbs = labeled & ~big
    candidate = off | crumbs
    interior = np.zeros_like(candidate)  # the centres of 3 x 3 squares of candidates
    interior[:, 1:-1, 1:-1] = np.logical_and.reduce([candidate[:, 1 + dy:h - 1 + dy, 1 + dx:w - 1 + dx]
                                                     for dy in (-1, 0, 1) for dx in (-1, 0, 1)])
    keys = np.where(candidate, 0, -1).astype(np.int64)
    roots, pixels = blob_roots(keys)
    if pixels.size == 0:
        return np.zeros(f, dtype=np.int64)
    blobs, inverse = np.unique(roots, return_inverse=True)
    has_interior = np.bincount(inverse, weights=interior.reshape(-1)[pixels], minlength=blobs.size) > 0
    return np.bincount(blobs[has_interior] // (h * w), minlength=f).astype(np.int64)


def _off_palette(frames: np.ndarray, bg: np.ndarray, colors: np.ndarray) -> np.ndarray:
    """[F, H, W] pixels farther than ARTIFACT_DISTANCE from the background and from every
    segment bg -> color of ``colors`` [K, 3] (alpha clipped to [0, 1])."""
    d = frames.astype(np.float32) - bg[:, None, None, :]  # [F, H, W, 3]
    n2 = np.einsum("fhwc,fhwc->fhw", d, d)  # [F, H, W]
    out = n2 > ARTIFACT_DISTANCE**2
    fi, ys, xs = np.nonzero(out)
    if fi.size == 0:
        return out
    p = d[fi, ys, xs]  # [N, 3]
    axes = colors[None] - bg[:, None, :]  # [F, K, 3]
    axis_n2 = np.maximum((axes * axes).sum(-1), 1.0)[fi]  # [N, K]
    proj = p @ colors.T - np.einsum("nc,nc->n", p, bg[fi])[:, None]  # [N, K]
    alpha = np.clip(proj / axis_n2, 0.0, 1.0)
    residual = n2[fi, ys, xs][:, None] - 2 * alpha * proj + alpha**2 * axis_n2
    out[fi, ys, xs] = residual.min(1) > ARTIFACT_DISTANCE**2
    return out


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
    roots, pixels = blob_roots(labels)
    if pixels.size == 0:
        return np.zeros(f, dtype=np.int64)
    blobs, area = np.unique(roots, return_counts=True)  # a blob never spans frames: no edge does
    return np.bincount(blobs[area >= min_area] // (h * w), minlength=f).astype(np.int64)


def _blob_areas(keys: np.ndarray) -> np.ndarray:
    """[F, H, W] the area of each pixel's blob (4-connected pixels of one key >= 0; 0 for key -1)."""
    roots, pixels = blob_roots(keys)
    out = np.zeros(keys.size, dtype=np.int64)
    if pixels.size:
        _, inverse, area = np.unique(roots, return_inverse=True, return_counts=True)
        out[pixels] = area[inverse]
    return out.reshape(keys.shape)


def blob_roots(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(roots [N], pixels [N]): the flat indices of the pixels with key >= 0 (ascending) and
    each one's blob id, the flat index of its blob's first pixel; a blob is 4-connected
    pixels of one key within one frame."""
    f, h, w = keys.shape
    flat = keys.reshape(-1)
    pixels = np.flatnonzero(flat >= 0)  # [N] object pixels, flat indices (ascending)
    if pixels.size == 0:
        return pixels, pixels
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
    return pixels[_union(pixels.size, a, b)], pixels


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


def silhouette_geometry(ys: np.ndarray, xs: np.ndarray, covered: np.ndarray) -> tuple[float, int]:
    """(solidity, largest hole) of one object's pixels (ys, xs) [N]: its area over its
    convex hull's (pixel squares; the world's circle, square and triangle are ~1, its cross
    ~0.7, its star ~0.6, a melted cross or star more) and the area in pixels of the largest
    run of see-through pixels it encloses (4-connected, not reaching its bounding box's
    edge; the world's shapes have none). ``covered`` [h, w] over the bounding box: pixels
    the object's color covers at least half (alpha >= 0.5), which are no hole even where
    H.264 tints them off the palette."""
    if ys.size == 0:
        return 0.0, 0
    y0, x0 = int(ys.min()), int(xs.min())
    h, w = int(ys.max()) - y0 + 1, int(xs.max()) - x0 + 1
    mask = np.zeros((h, w), dtype=bool)
    mask[ys - y0, xs - x0] = True
    solid = mask | covered
    # convex hull of the pixel squares: every row's leftmost and rightmost corner points
    rows = np.nonzero(mask.any(1))[0]
    left = mask[rows].argmax(1)
    right = w - 1 - mask[rows, ::-1].argmax(1)
    pts = np.concatenate([np.stack([left, rows], 1), np.stack([left, rows + 1], 1),
                          np.stack([right + 1, rows], 1), np.stack([right + 1, rows + 1], 1)]).astype(np.float64)
    hull = _hull_area(pts)
    # holes: non-object pixels of the box that no 4-connected path joins to the box's edge
    outside = np.pad(~solid, 1, constant_values=True)[None]  # [1, h+2, w+2], a ring joins every edge
    roots, pixels = blob_roots(np.where(outside, 0, -1).astype(np.int64))
    blobs, area = np.unique(roots, return_counts=True)
    edge = roots[0]  # flat index 0 is the ring's corner
    holes = area[blobs != edge]
    return float(ys.size / max(hull, 1.0)), int(holes.max()) if holes.size else 0


def _hull_area(pts: np.ndarray) -> float:
    """Area of the convex hull of points [N, 2] (Andrew's monotone chain, shoelace)."""
    points = [tuple(p) for p in np.unique(pts, axis=0).tolist()]  # sorted by x, then y; Python floats: ~10x faster
    if len(points) < 3:
        return 0.0

    def half(ordered: list[tuple[float, float]]) -> list[tuple[float, float]]:
        chain: list[tuple[float, float]] = []
        for x, y in ordered:
            while len(chain) >= 2 and ((chain[-1][0] - chain[-2][0]) * (y - chain[-2][1])
                                       - (chain[-1][1] - chain[-2][1]) * (x - chain[-2][0])) <= 0:
                chain.pop()
            chain.append((x, y))
        return chain

    poly = half(points)[:-1] + half(points[::-1])[:-1]
    return 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1])))
