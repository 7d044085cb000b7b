"""Shapes world: vocabulary, rendering, determinism, the held-out split, captions and parsing."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from omniloop.eval.shapes_render import coverage_table, object_centers_px, render_clip
from omniloop.eval.shapes_world import (
    BACKGROUNDS,
    COLORS,
    MOTIONS,
    SHAPES,
    ObjectSpec,
    Scene,
    all_captions,
    held_out_combos,
    held_out_prompts,
    is_held_out,
    parse_prompt,
    sample_object,
    scene_is_held_out,
)
from omniloop.train.data.shapes import ShapesDataset

DEMO_PROMPTS = [("red", "circle", "right"), ("blue", "square", "left"), ("green", "triangle", "up"),
                ("yellow", "star", "bouncing"), ("white", "cross", "static"), ("purple", "star", "circling")]


def _scene(color="red", shape="circle", motion="right", background="black", **kw) -> Scene:
    return Scene((ObjectSpec(color, shape, motion, **kw),), background)


# ---- vocabulary ------------------------------------------------------------------------


def test_vocabulary_is_rich_and_separable():
    assert {"circle", "square", "triangle"} < set(SHAPES) and len(SHAPES) >= 4
    assert len(COLORS) >= 6 and len(MOTIONS) >= 5 and len(BACKGROUNDS) >= 3
    rgb = np.array(list(COLORS.values()), dtype=float)
    pair_dist = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)[np.triu_indices(len(rgb), 1)]
    assert pair_dist.min() >= 100, pair_dist.min()
    for bg in BACKGROUNDS.values():  # every color stands out from every background
        assert (np.linalg.norm(rgb - np.array(bg), axis=1) >= 120).all(), bg


def test_scene_validation_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="unknown color 'pink'; pass one of"):
        ObjectSpec("pink", "circle")
    with pytest.raises(ValueError, match="leaves the frame"):
        ObjectSpec("red", "circle", "right", center=(0.9, 0.5), travel=0.6)
    with pytest.raises(ValueError, match="distinct colors"):
        Scene((ObjectSpec("red", "circle"), ObjectSpec("red", "square")))
    with pytest.raises(ValueError, match="1..2 objects"):
        Scene(())


# ---- rendering -------------------------------------------------------------------------


def test_every_combination_renders_a_whole_visible_object():
    """Every (shape, color, motion, background): in every frame the object's coverage
    (solved from the pixels) equals the shape's full area, so it is visible and never
    leaves the frame, and its fully covered pixels have exactly the object's color."""
    rng = np.random.default_rng(0)
    for shape, color, motion, bg in itertools.product(SHAPES, COLORS, MOTIONS, BACKGROUNDS):
        obj = sample_object(rng, color, shape, motion, size="small")
        clip = render_clip(Scene((obj,), bg), 48, 64, 5)
        c, b = np.array(COLORS[color], float), np.array(BACKGROUNDS[bg], float)
        alpha = ((clip - b) @ (c - b)) / ((c - b) @ (c - b))  # [F, H, W]
        _, diameter = object_centers_px(obj, 48, 64, 5)
        area = coverage_table(shape, int(round(diameter * 2)))[0, 0].sum()
        covered = alpha.sum((1, 2))
        assert np.allclose(covered, area, rtol=0.03), (shape, color, motion, bg, covered, area)
        assert ((np.abs(clip.astype(int) - c) <= 1).all(-1).sum((1, 2)) >= 0.4 * area).all()


def test_motions_follow_their_semantics():
    f = 17
    for motion, (dx, dy) in {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}.items():
        xy, _ = object_centers_px(ObjectSpec("red", "circle", motion), 128, 128, f)
        step = np.diff(xy, axis=0)
        assert np.allclose(step, step[0]) and np.allclose(np.sign(step[0]), (dx, dy))  # constant velocity
    xy, _ = object_centers_px(ObjectSpec("red", "circle", "static"), 128, 128, f)
    assert np.ptp(xy, axis=0).max() == 0
    bounce = ObjectSpec("red", "circle", "bouncing", center=(0.5, 0.5), travel=1.5, axis="x")
    x = object_centers_px(bounce, 128, 128, f)[0][:, 0]
    assert (np.diff(x) > 0).any() and (np.diff(x) < 0).any()  # reflects off a wall
    circle = ObjectSpec("red", "circle", "circling", radius=0.3, turns=1.0)
    xy, _ = object_centers_px(circle, 96, 160, f)  # a circle in pixels even on a wide frame
    r = np.linalg.norm(xy - xy[:-1].mean(0), axis=1)  # one full turn: the last frame repeats the first
    assert np.ptp(r) < 0.05 * r.mean()


def test_render_is_fast():
    scenes = [item.scene for item in held_out_prompts(60, seed=9)]
    render_clip(scenes[0])
    t0 = time.perf_counter()
    for scene in scenes:
        render_clip(scene, 128, 128, 17)
    per_clip_ms = (time.perf_counter() - t0) / len(scenes) * 1e3
    assert per_clip_ms < 25, per_clip_ms  # ~1-3 ms on one core; loose for shared CI machines


# ---- dataset ---------------------------------------------------------------------------


def test_dataset_is_a_pure_function_of_seed_and_index():
    a, b = ShapesDataset(seed=5, height=64, width=64), ShapesDataset(seed=5, height=64, width=64)
    first = [a[i] for i in (3, 1, 2)]
    second = [b[i] for i in (2, 3, 1)]  # another order, another instance
    for x, y in zip(first, [second[1], second[2], second[0]]):
        assert np.array_equal(x["video"], y["video"]) and x["caption"] == y["caption"] and x["scene"] == y["scene"]
    other = ShapesDataset(seed=6, height=64, width=64)
    assert any(other[i]["caption"] != a[i]["caption"] for i in range(5))
    item = a[0]
    assert item["video"].shape == (17, 64, 64, 3) and item["video"].dtype == np.uint8
    assert len(a) == 1_000_000 and a[-1]["caption"] == a[len(a) - 1]["caption"]
    with pytest.raises(IndexError):
        a[len(a)]


def test_image_samples_are_single_motionless_frames():
    ds = ShapesDataset(seed=1, height=32, width=32, image_prob=1.0)
    for i in range(20):
        item = ds[i]
        assert item["video"].shape == (1, 32, 32, 3)
        assert all(o.motion == "static" for o in item["scene"].objects)
        assert all(o.motion is None for o in parse_prompt(item["caption"]).objects), item["caption"]


def test_dataset_rejects_bad_config():
    with pytest.raises(ValueError, match="height, width >= 32"):
        ShapesDataset(height=16)
    with pytest.raises(ValueError, match="image_prob"):
        ShapesDataset(image_prob=1.5)


# ---- held-out split --------------------------------------------------------------------


def test_held_out_split_keeps_every_attribute_and_pair_in_training():
    held = set(held_out_combos())
    assert len(held) == len(COLORS) * len(SHAPES)  # one motion per (color, shape): 1/7 of combos
    train = {(c, s, m) for c in COLORS for s in SHAPES for m in MOTIONS} - held
    for i, j in itertools.combinations(range(3), 2):
        seen = {(k[i], k[j]) for k in train}
        values = [list(COLORS), list(SHAPES), list(MOTIONS)]
        assert seen == set(itertools.product(values[i], values[j]))
    assert not any(is_held_out(*demo) for demo in DEMO_PROMPTS)


def test_training_never_sees_held_out_scenes_and_eval_set_is_fixed():
    ds = ShapesDataset(seed=0, height=32, width=32, num_frames=2, two_object_prob=0.5)
    assert not any(scene_is_held_out(ds[i]["scene"]) for i in range(400))
    items = held_out_prompts(200, seed=0)
    assert len(items) == 200 and all(scene_is_held_out(it.scene) for it in items)
    assert len({it.prompt for it in items}) >= 190 and any(len(it.scene.objects) == 2 for it in items)
    again = held_out_prompts(200, seed=0)
    assert [it.prompt for it in again] == [it.prompt for it in items] and again[7].scene == items[7].scene
    assert [it.prompt for it in held_out_prompts(200, seed=1)] != [it.prompt for it in items]


# ---- captions and parsing --------------------------------------------------------------


def _expected(scene: Scene, with_motion: bool = True):
    return [(o.color, o.shape, o.motion if with_motion else None) for o in scene.objects]


def _got(parsed):
    return [(o.color, o.shape, o.motion) for o in parsed.objects]


def test_every_template_and_paraphrase_parses_back():
    scenes = []
    for i, motion in enumerate(MOTIONS):
        color, shape = list(COLORS)[i % len(COLORS)], SHAPES[i % len(SHAPES)]
        other = (list(COLORS)[(i + 3) % len(COLORS)], SHAPES[(i + 2) % len(SHAPES)], MOTIONS[(i + 4) % len(MOTIONS)])
        for axis in ("x", "y") if motion == "bouncing" else ("x",):
            a = ObjectSpec(color, shape, motion, size=("small", "medium", "large")[i % 3], axis=axis)
            scenes.append(Scene((a,), list(BACKGROUNDS)[i % len(BACKGROUNDS)]))
            scenes.append(Scene((a, ObjectSpec(*other, axis=axis)), list(BACKGROUNDS)[(i + 1) % len(BACKGROUNDS)]))
    n = 0
    for scene in scenes:
        for with_motion in (True, False):
            for caption in all_captions(scene, with_motion=with_motion):
                parsed = parse_prompt(caption)
                assert _got(parsed) == _expected(scene, with_motion), caption
                assert parsed.background in (None, scene.background), caption
                assert parsed.objects[0].size in (None, scene.objects[0].size), caption
                n += 1
    assert n > 1000


@pytest.mark.parametrize("prompt, expected, background", [
    ("a red circle moving right", [("red", "circle", "right")], None),
    ("a red circle slides to the right", [("red", "circle", "right")], None),
    ("red circle, moving rightward", [("red", "circle", "right")], None),
    ("a small red circle drifting right on a dark background", [("red", "circle", "right")], None),
    ("a red circle moving right and a blue square moving up",
     [("red", "circle", "right"), ("blue", "square", "up")], None),
    ("A RED CIRCLE, moving RIGHT!!", [("red", "circle", "right")], None),
    ("moving right: a red circle", [("red", "circle", "right")], None),
    ("a crimson ball rolling to the left in front of a light grey background",
     [("red", "circle", "left")], "light gray"),
    ("a violet plus sign bouncing up and down on a navy backdrop", [("purple", "cross", "bouncing")], "navy"),
    ("a blue circle moving in a circle", [("blue", "circle", "circling")], None),
    ("a golden star going from left to right", [("yellow", "star", "right")], None),
    ("the white cross doesn't move", [("white", "cross", "static")], None),
    ("a circle that is red", [("red", "circle", None)], None),
    ("a green triangle on a dark green background", [("green", "triangle", None)], "dark green"),
    ("a red shape", [("red", None, None)], None),
    ("something moving up", [(None, None, "up")], None),
])
def test_parse_paraphrases_and_synonyms(prompt, expected, background):
    parsed = parse_prompt(prompt)
    assert _got(parsed) == expected and parsed.background == background


@pytest.mark.parametrize("prompt", ["a photorealistic cat", "", "!!!", "un chat photoréaliste", "42", "background"])
def test_out_of_vocabulary_prompt_is_unknown_not_an_error(prompt):
    parsed = parse_prompt(prompt)
    assert not parsed.recognized
    assert _got(parsed) == [(None, None, None)] and parsed.background is None
