"""The procedural shapes-world dataset: captioned clips (and single frames) drawn by seed.

Item ``i`` of ``ShapesDataset(seed=s)`` is a pure function of ``(s, i)`` and the
constructor's sizes: its random stream is ``np.random.default_rng([s, 0, i])``, so items can
be drawn in any order, by any number of workers, and reproduced one by one.

Vocabulary, captions, the held-out split and the renderer live in ``omniloop.eval`` (the
evaluator and CLI need them, and nothing outside ``train`` may import ``train``); this
module only decides what training sees.

Held-out split (``shapes_world.is_held_out``): 40 of the 280 (color, shape, motion)
combinations, chosen by ``(color_index + 2*shape_index + 3*motion_index) % 7 == 5``, never
appear here, in any object of any scene; every single attribute value and every pair of
values still does. ``held_out_prompts(n, seed)`` draws evaluation prompts whose scenes
contain at least one held-out combination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np
from torch.utils.data import Dataset

from omniloop.eval.shapes_render import render_clip
from omniloop.eval.shapes_world import MOTIONS, EvalPrompt, Scene, describe, held_out_prompts, sample_scene

__all__ = ["EvalPrompt", "ShapesDataset", "ShapesSample", "held_out_prompts", "render_clip"]

_TRAIN_STREAM = 0  # SeedSequence([seed, 0, i]); the held-out prompts use [seed, 1]


class ShapesSample(TypedDict):
    video: np.ndarray  # [F, H, W, 3] uint8; F == 1 for an image sample
    caption: str
    scene: Scene


@dataclass(frozen=True)
class ShapesDataset(Dataset):
    """Captioned shapes-world clips, ``size`` items long, deterministic by ``seed``.

    ``image_prob``: fraction of items that are single frames (T2I samples) with a caption
    that states no motion; default 0, because a batch mixing clips and images does not
    stack (draw images from a second dataset with ``image_prob=1`` instead).
    The ``scene`` of a sample is a frozen dataclass, not a tensor: a DataLoader needs a
    ``collate_fn`` that keeps it as a list (or drops it).
    """

    seed: int = 0
    size: int = 1_000_000
    height: int = 128
    width: int = 128
    num_frames: int = 17
    image_prob: float = 0.0
    two_object_prob: float = 0.3

    def __post_init__(self) -> None:
        if self.seed < 0 or self.size < 1:
            raise ValueError(f"need seed >= 0 and size >= 1, got seed={self.seed}, size={self.size}")
        if min(self.height, self.width) < 32 or self.num_frames < 1:
            raise ValueError(f"need height, width >= 32 and num_frames >= 1, got "
                             f"{self.height}x{self.width}x{self.num_frames}")
        if not (0.0 <= self.image_prob <= 1.0 and 0.0 <= self.two_object_prob <= 1.0):
            raise ValueError(f"image_prob={self.image_prob} and two_object_prob={self.two_object_prob} "
                             f"must be in [0, 1]")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> ShapesSample:
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for ShapesDataset of size {self.size}")
        index %= self.size
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM, index])
        is_image = bool(rng.random() < self.image_prob)
        # NOTE: an image shows one instant, so its scene is static and its caption motionless
        scene = sample_scene(rng, split="train", two_object_prob=self.two_object_prob,
                             motions=("static",) if is_image else MOTIONS)
        caption = describe(scene, rng, with_motion=not is_image)
        video = render_clip(scene, self.height, self.width, 1 if is_image else self.num_frames)
        return {"video": video, "caption": caption, "scene": scene}
