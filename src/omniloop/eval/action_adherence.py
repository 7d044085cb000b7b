"""Action following, chunk by chunk: does the object move the way each chunk's action says?

For a clip made under actions ``a_1 .. a_k`` (chunk 0 is the first frame alone; chunk ``i``
is frames ``4i - 3 .. 4i``, ``eval/shapes_actions.py``), the object is tracked by its palette
color (the adherence evaluator's pixel labelling, its most frequent color) and chunk ``i``'s
displacement is its centroid at frame ``4i`` minus at frame ``4i - 4``. The chunk *reads* as
``stay`` when that displacement is under ``stay_fraction`` of the step an action makes
(``4 * speed`` free-region spans), else as the direction of its larger axis; the score is the
share of chunks that read as their action.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from omniloop.eval.adherence import _as_video, _background, _cores, _label_pixels, _PALETTE_NAMES
from omniloop.eval.shapes_actions import ACTION_NAMES, DEFAULT_SPEED, FRAMES_PER_CHUNK, check_action
from omniloop.eval.shapes_world import SIZES

STAY_FRACTION = 0.35  # a chunk moving less than this share of an action's step reads as "stay"


def object_track(video) -> tuple[str | None, np.ndarray]:
    """(color, centroids [F, 2] (x, y) px, NaN where the object is not seen) of the clip's
    main object: the palette color covering the most pixels."""
    frames = _as_video(video)
    labels = _label_pixels(frames, _background(frames))
    counts = np.bincount(labels.ravel().astype(np.int64) + 1, minlength=len(_PALETTE_NAMES) + 1)[1:]
    if counts.max() == 0:
        return None, np.full((frames.shape[0], 2), np.nan)
    k = int(counts.argmax())
    core = _cores(labels, k)
    out = np.full((frames.shape[0], 2), np.nan)
    for i in range(frames.shape[0]):
        ys, xs = np.nonzero(core[i] if core[i].any() else labels[i] == k)
        if ys.size:
            out[i] = (xs.mean(), ys.mean())
    return _PALETTE_NAMES[k], out


def read_direction(delta: np.ndarray, step_px: float, stay_fraction: float = STAY_FRACTION) -> str | None:
    """The action a displacement ``delta`` (dx, dy) px reads as; None when not measurable."""
    if not np.all(np.isfinite(delta)):
        return None
    if np.hypot(*delta) < stay_fraction * step_px:
        return "stay"
    dx, dy = delta
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


@dataclass(frozen=True)
class ChunkScore:
    index: int  # chunk index (>= 1)
    expected: str
    read: str | None
    delta: tuple[float, float]  # px

    @property
    def correct(self) -> bool:
        return self.read == self.expected


def score_clip(video, actions: Sequence[str], *, speed: float = DEFAULT_SPEED, size: str = "medium"
               ) -> list[ChunkScore]:
    """One score per chunk after the first; ``actions[i - 1]`` is chunk ``i``'s action."""
    frames = _as_video(video)
    chunks = 1 + len(actions)
    if frames.shape[0] < 1 + FRAMES_PER_CHUNK * (chunks - 1):
        raise ValueError(f"video has {frames.shape[0]} frames; {len(actions)} actions need "
                         f"{1 + FRAMES_PER_CHUNK * len(actions)} (1 + {FRAMES_PER_CHUNK} per action)")
    for a in actions:
        check_action(a)
    h, w = frames.shape[1:3]
    diameter = SIZES[size] * min(h, w)
    step_px = FRAMES_PER_CHUNK * speed * (min(h, w) - diameter)
    _, track = object_track(frames)
    out = []
    for i, action in enumerate(actions, start=1):
        delta = track[FRAMES_PER_CHUNK * i] - track[FRAMES_PER_CHUNK * (i - 1)]
        out.append(ChunkScore(i, action, read_direction(delta, step_px), (float(delta[0]), float(delta[1]))))
    return out


@dataclass
class ActionReport:
    chunks: list[ChunkScore] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.chunks)

    @property
    def accuracy(self) -> float:
        return sum(c.correct for c in self.chunks) / max(1, self.n)

    def by_action(self) -> dict[str, float]:
        out = {}
        for a in ACTION_NAMES:
            mine = [c for c in self.chunks if c.expected == a]
            if mine:
                out[a] = sum(c.correct for c in mine) / len(mine)
        return out

    def by_index(self) -> dict[int, float]:
        out = {}
        for i in sorted({c.index for c in self.chunks}):
            mine = [c for c in self.chunks if c.index == i]
            out[i] = sum(c.correct for c in mine) / len(mine)
        return out

    def confusion(self) -> dict[str, dict[str, int]]:
        out: dict[str, Counter] = {}
        for c in self.chunks:
            out.setdefault(c.expected, Counter())[str(c.read)] += 1
        return {k: dict(v) for k, v in out.items()}

    def summary(self) -> dict:
        return {"action_accuracy": self.accuracy, "chunks": self.n, "by_action": self.by_action(),
                "by_chunk": self.by_index(), "confusion": self.confusion()}


def evaluate_actions(clips: Iterable[tuple[np.ndarray, Sequence[str]]], *, speed: float = DEFAULT_SPEED
                     ) -> ActionReport:
    """Score ``(video, actions)`` pairs: per-chunk action-following accuracy."""
    report = ActionReport()
    for video, actions in clips:
        report.chunks.extend(score_clip(video, actions, speed=speed))
    return report
