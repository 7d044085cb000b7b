"""Adherence evaluator: accuracy on the world's own ground truth (clean, 64 px, blurred and
noisy, H.264), honest failures, no crashes on odd inputs, and the CLI end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniloop.api.cli import main
from omniloop.eval.adherence import evaluate, evaluate_clip
from omniloop.eval.shapes_render import render_clip
from omniloop.eval.shapes_world import ObjectSpec, Scene, held_out_prompts
from omniloop.io.video import write_mp4
from omniloop.train.data.shapes import ShapesDataset

N_CLIPS = 300


def _blur_and_noise(video: np.ndarray, sigma: float, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Separable Gaussian blur over H and W, then Gaussian noise: a stand-in for a soft generator."""
    r = int(np.ceil(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    x = np.pad(video.astype(np.float32), ((0, 0), (r, r), (r, r), (0, 0)), mode="edge")
    h, w = video.shape[1:3]
    x = sum(k[i] * x[:, i:i + h] for i in range(2 * r + 1))
    x = sum(k[i] * x[:, :, i:i + w] for i in range(2 * r + 1))
    return np.clip(np.round(x + rng.normal(0, noise, x.shape)), 0, 255).astype(np.uint8)


def _assert_accurate(report, at_least=0.98):
    assert report.n_clips >= N_CLIPS
    for attribute in ("color", "shape", "motion"):
        assert report.attributes[attribute]["scored"] >= N_CLIPS
        assert report.accuracy(attribute) >= at_least, (attribute, report.attributes[attribute], report.failures[:3])
    # ground truth holds to its last frame: no false alarm of the stability check (shape, size, specks included)
    assert report.stability["stable"] == 1.0, [f["stability"]["why"] for f in report.failures if not f["stable"]][:3]


# ---- ground truth ----------------------------------------------------------------------


def test_ground_truth_held_out_clips_128px():
    items = held_out_prompts(N_CLIPS, seed=0)
    _assert_accurate(evaluate((render_clip(it.scene, 128, 128, 17), it.prompt) for it in items))


def test_ground_truth_training_clips_64px():
    ds = ShapesDataset(seed=1, height=64, width=64)
    _assert_accurate(evaluate((ds[i]["video"], ds[i]["caption"]) for i in range(N_CLIPS)))


def test_ground_truth_blurred_and_noisy_64px():
    ds = ShapesDataset(seed=2, height=64, width=64, two_object_prob=0.5)
    rng = np.random.default_rng(0)
    pairs = ((_blur_and_noise(ds[i]["video"], 1.0, 8.0, rng), ds[i]["caption"]) for i in range(N_CLIPS))
    _assert_accurate(evaluate(pairs))


# ---- honesty and edge cases ------------------------------------------------------------


def _clip(*objects: ObjectSpec, background="black", size=64, frames=9) -> np.ndarray:
    return render_clip(Scene(tuple(objects), background), size, size, frames)


def test_a_wrong_prompt_scores_wrong():
    video = _clip(ObjectSpec("red", "circle", "right"))
    clip = evaluate_clip(video, "a blue square moving left")
    assert [clip.outcome(a) for a in ("color", "shape", "motion")] == ["wrong"] * 3
    right = evaluate_clip(video, "a red circle moving right")
    assert right.all_correct and not clip.all_correct


def test_two_objects_are_matched_in_any_prompt_order():
    video = _clip(ObjectSpec("red", "circle", "right", center=(0.5, 0.2)),
                  ObjectSpec("blue", "square", "up", center=(0.2, 0.5), travel=0.5))
    clip = evaluate_clip(video, "a blue square moving up and a red circle sliding to the right")
    assert clip.all_correct, clip.to_dict()
    half = evaluate_clip(video, "a blue square moving up and a green star moving down")
    assert [half.outcome(a, 0) for a in ("color", "shape", "motion")] == ["correct"] * 3
    # the other object drawn is not what was asked: wrong on every attribute (not a miss)
    assert [(s.predicted, s.outcome) for s in half.scores if s.object == 1] == [
        ("red", "wrong"), ("circle", "wrong"), ("right", "wrong")]
    alone = evaluate_clip(_clip(ObjectSpec("blue", "square", "up")),
                          "a blue square moving up and a green star moving down")
    assert [alone.outcome(a, 1) for a in ("color", "shape", "motion")] == ["miss"] * 3  # nothing left to match


def test_out_of_vocabulary_prompt_is_unknown():
    report = evaluate([(_clip(ObjectSpec("red", "circle", "right")), "a photorealistic cat")])
    for attribute, row in report.attributes.items():
        assert row["unknown"] == 1 and row["scored"] == 0 and row["accuracy"] is None, attribute
    assert report.clip_accuracy is None
    partial = evaluate_clip(_clip(ObjectSpec("red", "circle", "right")), "a red shape")
    outcomes = (partial.outcome("color"), partial.outcome("shape"), partial.outcome("motion"))
    assert outcomes == ("correct", "unknown", "unknown")


def test_nothing_detected_is_a_miss_not_a_crash():
    report = evaluate([(np.zeros((9, 64, 64, 3), np.uint8), "a red circle moving right on a black background")])
    assert [report.attributes[a]["miss"] for a in ("color", "shape", "motion")] == [1, 1, 1]
    assert report.accuracy("color") == 0.0 and report.accuracy("background") == 1.0
    json.loads(report.to_json())


def test_odd_videos_do_not_crash():
    rng = np.random.default_rng(0)
    two_blobs = _clip(ObjectSpec("red", "circle", center=(0.0, 0.0)), ObjectSpec("blue", "square", center=(1.0, 1.0)))
    two_blobs[two_blobs[..., 2] > 200] = (225, 25, 35)  # two red blobs far apart
    videos = [rng.integers(0, 256, (9, 64, 64, 3), dtype=np.uint8), two_blobs, np.full((5, 48, 80, 3), 200, np.uint8),
              np.broadcast_to(np.linspace(0, 255, 64, dtype=np.uint8)[None, None, :, None], (5, 64, 64, 3))]
    report = evaluate((v, "a red circle moving right") for v in videos)
    assert report.n_clips == 4 and json.loads(report.to_json())["n_clips"] == 4


def test_a_shapeless_smudge_is_no_shape():
    """A blob or a ring is a miss for every shape prompt, not a lucky match to the nearest template."""
    yy, xx = np.mgrid[:64, :64]
    r = np.hypot(yy - 32, xx - 32)
    for alpha in (np.exp(-(r**2) / (2 * 3.0**2)), np.exp(-(r**2) / (2 * 8.0**2)), (r > 9) & (r < 14)):
        video = np.repeat((alpha[None, :, :, None] * np.array([225, 25, 35])).astype(np.uint8), 5, axis=0)
        for shape in ("circle", "star"):
            clip = evaluate_clip(video, f"a red {shape} standing still")
            assert [clip.outcome(a) for a in ("color", "shape", "motion")] == ["correct", "miss", "correct"]


def test_a_single_frame_cannot_show_motion():
    clip = evaluate_clip(_clip(ObjectSpec("green", "star", "static"), frames=1)[0], "a green star moving up")
    assert (clip.outcome("color"), clip.outcome("shape"), clip.outcome("motion")) == ("correct", "correct", "miss")


@pytest.mark.parametrize("video, match", [
    (np.zeros((4, 16, 64, 3), np.uint8), "at least 32x32"),
    (np.zeros((4, 64, 64, 3), np.float32), "must be uint8"),
    (np.zeros((64, 64), np.uint8), r"\[F, H, W, 3\]"),
])
def test_malformed_video_is_a_clear_error(video, match):
    with pytest.raises(ValueError, match=match):
        evaluate_clip(video, "a red circle")


def test_report_is_json_with_confusion():
    a = _clip(ObjectSpec("red", "circle", "right"))
    report = evaluate([(a, "a red circle moving right"), (a, "an orange square moving right")])
    data = json.loads(report.to_json())
    assert data["attributes"]["color"] == {"accuracy": 0.5, "correct": 1, "wrong": 1, "miss": 0, "unknown": 0,
                                           "scored": 2}
    assert data["confusion"]["color"] == {"red": {"red": 1}, "orange": {"red": 1}}
    assert data["clip_accuracy"] == 0.5 and len(data["failures"]) == 1


# ---- CLI, through H.264 ----------------------------------------------------------------


def test_cli_eval_adherence_on_mp4s(tmp_path, capsys):
    items = held_out_prompts(8, seed=3)
    rows = []
    for i, it in enumerate(items):
        path = tmp_path / f"clip{i}.mp4"
        write_mp4(render_clip(it.scene, 128, 128, 17), path, fps=8)
        if i % 2:
            (tmp_path / f"clip{i}.txt").write_text(it.prompt)  # sidecar
        else:
            rows.append(json.dumps({"video": path.name, "prompt": it.prompt}))
    (tmp_path / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "report.json"
    assert main(["eval", "adherence", "--videos", str(tmp_path), "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--output", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text()) and report["n_clips"] == 8
    for attribute in ("color", "shape", "motion"):
        assert report["attributes"][attribute]["accuracy"] == 1.0, report["failures"]

    assert main(["eval", "adherence", "--videos", str(tmp_path / "clip*.mp4")]) == 2  # even clips: no prompt
    assert "no prompt for" in capsys.readouterr().err


def test_cli_ground_truth_self_check(capsys):
    assert main(["eval", "adherence", "--ground-truth", "6", "--size", "64", "--h264"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_clips"] == 6 and report["clip_accuracy"] == 1.0
    assert main(["eval", "adherence"]) == 2
    assert "--ground-truth N" in capsys.readouterr().err
