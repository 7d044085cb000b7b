"""The quality gate of the embedded default: the shipped 4-step student generates a fixed set
of held-out prompts on the CPU (16 videos, ~10 s on 2 idle cores) and must clear per-frame
stability and adherence thresholds, so a regression in the shipped weights fails CI.

Thresholds: the student's figures on this set (session-5 weights, CPU fp32: color 100%,
shape 86%, motion 68%, count 88%; stable 0% with the session-5 VAE, whose frames 13-16
collapse) less a margin of ~2-3 objects (one object is ~5 points here). ``stable`` and the
per-frame bar are the issue-15 targets; re-measure them when new weights ship
(``python -m omniloop.train.recipes.evaluate --model shapes-t2v-4step --n 16 --device cpu``
prints the figures) and tighten.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.cpu_threads import apply_cpu_threads
from omniloop.models.manifest import read_manifest
from omniloop.models.loader import BUILTIN_MODELS
from omniloop.train.recipes.evaluate import evaluate_model
from omniloop.train.recipes.shapes_model import STUDENT_NAME
from tests.shipped import SESSION5_REASON, SHIPS_SESSION5_VAE

N_PROMPTS = 16  # held_out_prompts(16, seed=0): 10 one-object and 6 two-object prompts
THRESHOLDS = {"color": 0.85, "shape": 0.7, "motion": 0.5, "count": 0.75, "stable": 0.7}
MAX_FAILING_AT_ANY_FRAME = 0.3  # share of the clips failing at one frame index
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


@pytest.mark.xfail(SHIPS_SESSION5_VAE, strict=True, reason=SESSION5_REASON)
def test_the_shipped_student_holds_to_the_last_frame(student_figures):
    stability = student_figures["stability"]
    assert stability["stable"] >= THRESHOLDS["stable"], stability
    worst = max(range(len(stability["failing_by_frame"])), key=stability["failing_by_frame"].__getitem__)
    assert stability["failing_by_frame"][worst] <= MAX_FAILING_AT_ANY_FRAME, (
        f"frame {worst}: {stability['failing_by_frame'][worst]:.0%} of the clips fail there ({stability})")


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
