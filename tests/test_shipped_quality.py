"""The quality gate of the embedded default: the shipped 4-step student generates a fixed set
of held-out prompts on the CPU (16 videos) and must clear per-frame stability and adherence
thresholds, so a regression in the shipped weights fails CI.

Measured on the shipped weights (issue 15's (b1)/(b2) student, CPU fp32, 1 thread):
color 95.5%, shape 81.8%, motion 77.3% (22 objects), count 75%; on 8 images color 90%, shape
60%. Stability with the stricter check of issue 30 item 7 (an object that loses its shape,
grows a hole or changes size, and specks, are failures too): stable 43.75% (7 of 16 clips; 5
of the 10 one-object clips), at most 37.5% of the clips failing at any frame index (frame 5).
The older check (background, object count, artifact area only) read 75% stable (12 of 16; 9
of 10 one-object clips), at most 12.5% failing at one frame index: it passed a white cross
ending in a holed blob with a yellow speck. With the session-5 VAE (9-frame training, frames
13-16 collapsed) stable was 0% and every clip failed at frames 13-16.
Thresholds: those figures less a margin of 1-3 objects or clips (one object is ~4.5 points,
one clip 6.25, one of the 10 one-object clips 10; CI's thread count may flip a clip).
Re-measure when new weights ship and tighten:
``python -m omniloop.train.recipes.evaluate --model shapes-t2v-4step --n 16 --images 8 --max-batch 8 --device cpu``.

Cost: 16 x (4 DiT forwards + a 17x128x128 VAE decode; the decode is ~80%): 0.65 s a video on
2 idle cores (benchmarks/results/shapes_cpu_trained.jsonl), ~15 s with the load; ~4 s of CPU a
video at one thread on a shared box under load (minutes of wall time): slow-marked, run in CI.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.cpu_threads import apply_cpu_threads
from omniloop.models.loader import BUILTIN_MODELS
from omniloop.models.manifest import read_manifest
from omniloop.train.recipes.evaluate import evaluate_model
from omniloop.train.recipes.shapes_model import STUDENT_NAME

pytestmark = pytest.mark.slow

N_PROMPTS = 16  # held_out_prompts(16, seed=0): 10 one-object and 6 two-object prompts
THRESHOLDS = {"color": 0.9, "shape": 0.75, "motion": 0.7, "count": 0.68, "stable": 0.3}
ONE_OBJECT_STABLE = 0.4  # the 10 one-object clips: a collapsing end fails every one of them
MAX_FAILING_AT_ANY_FRAME = 0.5  # share of the clips failing at one frame index
IMAGE_THRESHOLDS = {"color": 0.75, "shape": 0.5}  # once the student declares T2I (8 prompts)


@pytest.fixture(scope="module")
def student_figures():
    before = torch.get_num_threads()
    apply_cpu_threads("auto")
    try:
        images = 8 if "t2i" in read_manifest(BUILTIN_MODELS[STUDENT_NAME]).tasks else 0
        return evaluate_model(STUDENT_NAME, n=N_PROMPTS, seed=0, device="cpu", max_batch=8, images=images)
    finally:
        torch.set_num_threads(before)


def test_the_shipped_student_holds_to_the_last_frame(student_figures):
    stability = student_figures["stability"]
    assert stability["stable"] >= THRESHOLDS["stable"], stability
    one = student_figures["by_objects"]["1"]
    assert one["stable"] >= ONE_OBJECT_STABLE, f"one-object clips: {one}"
    failing = stability["failing_by_frame"]
    assert len(failing) == 17  # every frame index of the default clip is scored
    worst = max(range(len(failing)), key=failing.__getitem__)
    assert failing[worst] <= MAX_FAILING_AT_ANY_FRAME, (
        f"frame {worst}: {failing[worst]:.0%} of the clips fail there ({stability})")


def test_the_shipped_student_shows_the_prompt(student_figures):
    adherence = student_figures["adherence"]
    low = {k: adherence[k] for k, v in THRESHOLDS.items() if k != "stable" and adherence[k] < v}
    assert not low, f"under the quality bar {THRESHOLDS}: {low} (all figures: {adherence})"


def test_the_shipped_student_makes_images_or_says_it_cannot(student_figures):
    images = student_figures.get("images")
    if images is None:  # not declared: the generator, CLI and server refuse T2I (tests/serve/test_video_only_model.py)
        assert "t2i" not in read_manifest(BUILTIN_MODELS[STUDENT_NAME]).tasks
        return
    low = {k: images[k] for k, v in IMAGE_THRESHOLDS.items() if images[k] < v}
    assert not low, f"images under {IMAGE_THRESHOLDS}: {low} ({images})"
