"""The shapes world driven by actions: clips whose object follows one action per chunk.

An interactive clip is a scene of one object (color, shape, size) on a background, and a
sequence of actions from :data:`ACTIONS` -- one per *chunk* after the first. A chunk is one
latent frame of the causal VAE: the first chunk is the clip's first frame alone (the scene as
it starts), every later chunk :data:`FRAMES_PER_CHUNK` frames, during which the object moves
``speed`` free-region units per frame in the chunk's action direction (``stay``: it holds
still). The world is clamped: an object pushed into a wall stops there.

So a clip of ``k`` actions has ``1 + 4k`` frames (``4k + 1``, the VAE's frame rule) and
``1 + k`` latent frames, chunk ``i >= 1`` spanning frames ``4i - 3 .. 4i``. Coordinates are
``shapes_world``'s free-region units (``v`` grows downward, so ``up`` decreases it).

Shared by the training data (``train/recipes/interactive.py``), the per-chunk action
evaluator (``eval/action_adherence.py``) and the model's action vocabulary, hence in ``eval``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniloop.eval.shapes_render import draw_path
from omniloop.eval.shapes_world import BACKGROUNDS, COLORS, SHAPES, SIZES, ObjectSpec, Scene, describe

# The action vocabulary: name -> (dx, dy) direction in image axes (y grows downward).
ACTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1), "stay": (0, 0)}
ACTION_NAMES: tuple[str, ...] = tuple(ACTIONS)
FRAMES_PER_CHUNK = 4  # the VAE's temporal factor: one latent frame
DEFAULT_SPEED = 0.05  # free-region units per frame (0.2 of the free span per chunk)
INTERACTIVE_SIZES = ("medium", "large")  # small objects are a pixel smudge in an 8x8 latent


def check_action(name: str) -> str:
    if name not in ACTIONS:
        raise ValueError(f"unknown action {name!r}; pass one of {list(ACTION_NAMES)}")
    return name


def num_frames(chunks: int) -> int:
    """Video frames of a clip whose first chunk is one frame and ``chunks - 1`` chunks follow."""
    return 1 + FRAMES_PER_CHUNK * (chunks - 1)


@dataclass(frozen=True, slots=True)
class ActionClip:
    """One object steered by ``actions`` (one per chunk after the first) from ``start``."""

    color: str
    shape: str
    actions: tuple[str, ...]
    size: str = "medium"
    scale: float = 1.0
    background: str = "black"
    start: tuple[float, float] = (0.5, 0.5)  # free-region (u, v) at frame 0
    speed: float = DEFAULT_SPEED

    def __post_init__(self) -> None:
        for a in self.actions:
            check_action(a)
        if not (0.0 <= self.start[0] <= 1.0 and 0.0 <= self.start[1] <= 1.0):
            raise ValueError(f"start={self.start} must lie in [0, 1]^2 (free-region units)")
        if not 0.0 < self.speed <= 0.25:
            raise ValueError(f"speed={self.speed} must be in (0, 0.25] free-region units per frame")
        ObjectSpec(color=self.color, shape=self.shape, size=self.size, scale=self.scale)  # checks the vocabulary
        if self.background not in BACKGROUNDS:
            raise ValueError(f"unknown background {self.background!r}; pass one of {list(BACKGROUNDS)}")

    @property
    def num_frames(self) -> int:
        return num_frames(len(self.actions) + 1)

    @property
    def scene(self) -> Scene:
        """The clip's first frame as a static scene (its caption describes this)."""
        obj = ObjectSpec(color=self.color, shape=self.shape, size=self.size, scale=self.scale, center=self.start)
        return Scene((obj,), self.background)

    def path(self) -> np.ndarray:
        """Free-region centre per frame, [F, 2] (u, v): clamped to [0, 1] at every frame."""
        pos = np.asarray(self.start, dtype=np.float64)
        out = [pos.copy()]
        for action in self.actions:
            step = self.speed * np.asarray(ACTIONS[action], dtype=np.float64)
            for _ in range(FRAMES_PER_CHUNK):
                pos = np.clip(pos + step, 0.0, 1.0)
                out.append(pos.copy())
        return np.stack(out)

    def caption(self, rng: np.random.Generator) -> str:
        return describe(self.scene, rng, with_motion=False)


def centers_px(clip: ActionClip, height: int, width: int) -> tuple[np.ndarray, float]:
    """Pixel centres [F, 2] (x, y) and the diameter in pixels (``shapes_render``'s mapping)."""
    diameter = round(SIZES[clip.size] * clip.scale * min(height, width) * 2) / 2
    spans = np.array([width, height], dtype=np.float64) - diameter
    return diameter / 2 + clip.path() * spans, diameter


def render_action_clip(clip: ActionClip, height: int = 64, width: int = 64) -> np.ndarray:
    """[F, H, W, 3] uint8: the background, then the object along its steered path."""
    frames = np.empty((clip.num_frames, height, width, 3), dtype=np.uint8)
    frames[:] = np.tile(np.asarray(BACKGROUNDS[clip.background], dtype=np.uint8), (width, 1))
    xy, diameter = centers_px(clip, height, width)
    draw_path(frames, clip.shape, clip.color, xy, diameter)
    return frames


def sample_actions(rng: np.random.Generator, n: int, *, repeat: float = 0.5) -> tuple[str, ...]:
    """``n`` actions: each repeats the previous with probability ``repeat``, else is uniform."""
    out: list[str] = []
    for _ in range(n):
        if out and rng.random() < repeat:
            out.append(out[-1])
        else:
            out.append(ACTION_NAMES[int(rng.integers(len(ACTION_NAMES)))])
    return tuple(out)


def free_actions(rng: np.random.Generator, start: tuple[float, float], n: int, speed: float) -> tuple[str, ...]:
    """``n`` actions that never push the object into a wall (evaluation: every chunk's
    expected motion is its action's, none blocked); ``stay`` at most one chunk in five."""
    pos = np.asarray(start, dtype=np.float64)
    reach = speed * FRAMES_PER_CHUNK
    out: list[str] = []
    for _ in range(n):
        moves = [a for a, d in ACTIONS.items() if d != (0, 0) and np.all((0 <= pos + reach * np.asarray(d))
                                                                          & (pos + reach * np.asarray(d) <= 1))]
        pool = moves + (["stay"] if rng.random() < 0.2 else [])
        action = pool[int(rng.integers(len(pool)))] if pool else "stay"
        pos = pos + reach * np.asarray(ACTIONS[action], dtype=np.float64)
        out.append(action)
    return tuple(out)


def sample_action_clip(rng: np.random.Generator, chunks: int, *, free: bool = False,
                       speed: float = DEFAULT_SPEED) -> ActionClip:
    """A random clip of ``chunks`` chunks (``chunks - 1`` actions). ``free``: actions that
    never meet a wall (evaluation), else random ones that may (training: the world clamps)."""
    color = str(rng.choice(list(COLORS)))
    shape = str(rng.choice(SHAPES))
    size = str(rng.choice(INTERACTIVE_SIZES))
    background = str(rng.choice(list(BACKGROUNDS)))
    start = (float(rng.uniform(0.1, 0.9)), float(rng.uniform(0.1, 0.9)))
    actions = free_actions(rng, start, chunks - 1, speed) if free else sample_actions(rng, chunks - 1)
    return ActionClip(color=color, shape=shape, actions=actions, size=size, scale=float(rng.uniform(0.92, 1.08)),
                      background=background, start=start, speed=speed)
