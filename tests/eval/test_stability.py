"""Temporal stability scores: ground truth holds to its last frame; a clip whose end is
corrupted (background darkened, blotches, an extra object) fails, naming the frame."""

from __future__ import annotations

import numpy as np
import pytest

from omniloop.eval.adherence import evaluate, evaluate_clip
from omniloop.eval.shapes_render import render_clip
from omniloop.eval.shapes_world import COLORS, ObjectSpec, Scene, held_out_prompts
from omniloop.eval.stability import MAX_ARTIFACT_FRACTION, MAX_DRIFT

PROMPT = "a red circle moving right on a light gray background"
SCENE = Scene((ObjectSpec(color="red", shape="circle", motion="right", center=(0.5, 0.3)),), "light gray")


def _clip(frames: int = 17) -> np.ndarray:
    return render_clip(SCENE, 128, 128, frames)


def _failing(video: np.ndarray, prompt: str = PROMPT):
    clip = evaluate_clip(video, prompt)
    return clip, clip.detection.stability


def test_clean_clip_is_stable_and_correct():
    clip, stability = _failing(_clip())
    assert stability.stable and stability.failing_frames == () and stability.usual_objects == 1, stability.explain()
    assert clip.prompt_correct and clip.all_correct
    assert max(f.background_drift for f in stability.frames) == 0.0
    assert max(f.artifact_fraction for f in stability.frames) == 0.0


def test_darkened_background_at_the_end_fails_naming_the_frames():
    video = _clip()
    gray = np.all(video == 170, axis=-1)  # background pixels
    for t in (14, 15, 16):
        video[t][gray[t]] = (150 - 20 * (t - 14),) * 3  # drift 35, 69, 104
    clip, stability = _failing(video)
    assert stability.failing_frames == (14, 15, 16), stability.explain()
    assert all(stability.frames[t].problems == ("background",) for t in (14, 15, 16))
    assert stability.frames[14].background_drift > MAX_DRIFT and stability.frames[13].background_drift == 0
    # color, shape and motion still read right: only the stability verdict catches it
    assert clip.prompt_correct and not clip.all_correct
    assert "frame 14: background" in stability.explain()


def test_blotches_at_the_end_are_artifacts():
    video = _clip()
    rng = np.random.default_rng(0)
    for t in (15, 16):
        for _ in range(6):  # dark-brown smudges: far from the gray background and from every object color
            y, x = rng.integers(70, 118, size=2)
            video[t, y:y + 10, x:x + 10] = (60, 35, 20)
    clip, stability = _failing(video)
    assert stability.failing_frames == (15, 16), stability.explain()
    assert all("artifacts" in stability.frames[t].problems for t in (15, 16))
    assert stability.frames[16].artifact_fraction > MAX_ARTIFACT_FRACTION
    assert not clip.all_correct


def test_an_extra_object_in_the_last_frames_fails_and_a_constant_one_is_a_count_error():
    video = _clip()
    extra = render_clip(Scene((ObjectSpec(color="red", shape="square", center=(0.2, 0.85)),), "light gray"), 128, 128, 17)
    red = np.all(extra == COLORS["red"], axis=-1)
    video[13:][red[13:]] = COLORS["red"]  # a second red blob from frame 13 on
    _, stability = _failing(video)
    assert stability.usual_objects == 1 and stability.failing_frames == (13, 14, 15, 16), stability.explain()
    assert all(stability.frames[t].problems == ("objects",) for t in (13, 14, 15, 16))
    # an extra object in every frame is stable, but the count attribute is wrong
    video = _clip()
    video[red] = COLORS["red"]
    clip, stability = _failing(video)
    assert stability.stable and stability.usual_objects == 2
    assert clip.outcome("count", None) == "wrong" and not clip.all_correct


@pytest.mark.parametrize("frames", [1, 5, 33])
def test_every_clip_length_and_a_single_image(frames):
    _, stability = _failing(_clip(frames))
    assert stability.stable and len(stability.frames) == frames


def test_report_carries_stability_per_frame_and_two_object_groups():
    items = held_out_prompts(12, seed=4, two_object_prob=0.5)
    videos = [render_clip(it.scene, 128, 128, 17) for it in items]
    videos[0] = videos[0].copy()
    videos[0][16] = 255 - videos[0][16]  # the last frame inverted
    report = evaluate(zip(videos, [it.prompt for it in items]))
    st = report.stability
    assert st["clips"] == 12 and st["stable"] == pytest.approx(11 / 12)
    assert st["per_frame"][16]["failing"] == pytest.approx(1 / 12, abs=1e-4) and st["per_frame"][15]["failing"] == 0
    assert st["worst_frame"] == 16
    two = report.by_objects["2"]
    assert two["clips"] == sum(len(it.scene.objects) == 2 for it in items) >= 3
    assert two["count"] == 1.0 and two["color_all"] == 1.0 and two["motion_all"] == 1.0
    assert report.prompt_accuracy > report.clip_accuracy  # the inverted clip reads right but is not stable
    assert report.accuracy("count") == 1.0
    failure = next(f for f in report.failures if not f["stable"])
    assert failure["stability"]["failing_frames"] == [16] and "frame 16" in failure["stability"]["why"]
