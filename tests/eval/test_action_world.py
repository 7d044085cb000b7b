"""The shapes world driven by actions and the per-chunk action evaluator."""

import numpy as np
import pytest

from omniloop.eval.action_adherence import evaluate_actions, read_direction, score_clip
from omniloop.eval.shapes_actions import (ACTION_NAMES, ActionClip, num_frames, render_action_clip,
                                          sample_action_clip)


def test_clip_frames_follow_actions_and_clamp_at_walls():
    clip = ActionClip(color="red", shape="circle", actions=("right", "right", "up", "stay"), start=(0.5, 0.5))
    assert clip.num_frames == num_frames(5) == 17
    path = clip.path()
    assert path.shape == (17, 2)
    np.testing.assert_allclose(path[4] - path[0], [0.2, 0.0])
    np.testing.assert_allclose(path[12] - path[8], [0.0, -0.2])
    np.testing.assert_allclose(path[16], path[12])
    wall = ActionClip(color="red", shape="circle", actions=("left",) * 3, start=(0.1, 0.5)).path()
    assert wall[:, 0].min() == 0.0 and wall[-1, 0] == 0.0  # clamped, never outside the frame
    video = render_action_clip(clip, 64, 64)
    assert video.shape == (17, 64, 64, 3) and video.dtype == np.uint8


def test_unknown_action_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown action 'jump'.*'left'"):
        ActionClip(color="red", shape="circle", actions=("jump",))


def test_evaluator_reads_ground_truth_clips_perfectly():
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(12):
        clip = sample_action_clip(rng, 7, free=True)
        pairs.append((render_action_clip(clip, 64, 64), clip.actions))
    report = evaluate_actions(pairs)
    assert report.n == 72
    assert report.accuracy == 1.0, report.confusion()
    assert set(report.by_action()) <= set(ACTION_NAMES)


def test_evaluator_catches_wrong_directions():
    clip = ActionClip(color="blue", shape="square", actions=("right", "down"), start=(0.3, 0.3))
    video = render_action_clip(clip, 64, 64)
    scores = score_clip(video, ("left", "down"))
    assert [s.correct for s in scores] == [False, True]
    assert scores[0].read == "right"
    assert read_direction(np.array([0.5, -0.3]), 10.0) == "stay"
    assert read_direction(np.array([np.nan, 0.0]), 10.0) is None
