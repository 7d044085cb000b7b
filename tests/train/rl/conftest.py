"""Tiny Wan checkpoints (tests/wan_checkpoint.py) as the RL rollout engine, on the CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.train.rl import RolloutSpec

# 4 steps of 32x32x5: a tiny Wan rollout is ~10 ms a step
SPEC = RolloutSpec(steps=4, height=32, width=32, num_frames=5, decode=False)
PROMPT = "a red circle moving right"


@pytest.fixture
def generator(wan_t2v_dir):
    """A fresh pipeline per test (tests train its transformer or install plugins on it)."""
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    yield gen
    gen.close()


def latent_mean_scorer(name: str = "latent_mean"):
    """A cheap in-process scorer: the final latents' mean (rewards that differ within a group)."""

    class LatentMean:
        def __init__(self) -> None:
            self.name = name

        def score(self, trajectories):
            return [float(t.final_latents.mean()) for t in trajectories]

    return LatentMean()


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
