"""One ``suggest_task`` (request/tasks.py) for every front end: its fixed preference order, and
the same suggestion under any ``PYTHONHASHSEED`` on real (tiny) Flux, Wan, LTX-2 and Stable
Audio checkpoints, through the offline API, the CLI, the HTTP translation and warmup."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniloop.request import TASK_IO, Modality, TaskType, suggest_task
from omniloop.request.tasks import PREFERENCE, fits

T = TaskType
IMAGE, VIDEO, AUDIO = Modality.IMAGE, Modality.VIDEO, Modality.AUDIO
FLUX, WAN_T2V, WAN_I2V = {T.T2I, T.I2I}, {T.T2V, T.T2I, T.V2V}, {T.I2V}
LTX2, STABLE_AUDIO, QWEN2 = {T.T2V, T.T2VS, T.I2V}, {T.T2A}, {T.REASON}
COSMOS3 = {T.T2I, T.T2V, T.I2V, T.V2W, T.T2VS, T.A2W, T.REASON}


# -- the preference order (no checkpoint) ------------------------------------------------


@pytest.mark.parametrize("served,given,wants,expected", [
    (FLUX, (), (), T.T2I),  # an image model: the task that needs no input
    (FLUX, (IMAGE,), (), T.I2I),  # ... and with an image, the edit
    (FLUX, (), (VIDEO,), T.T2I),  # asked for a video, it still makes what it can (one frame)
    (WAN_T2V, (), (), T.T2V),  # t2v over t2i for a video model
    (WAN_T2V, (), (IMAGE,), T.T2I),
    (WAN_T2V, (IMAGE,), (VIDEO,), T.I2V),  # the image is not dropped: i2v, which admission refuses by name
    (WAN_I2V, (), (), T.I2V),  # missing its image: admission says to add it
    (WAN_I2V, (IMAGE,), (), T.I2V),
    (LTX2, (), (), T.T2V),
    (LTX2, (IMAGE,), (), T.I2V),  # i2v only when an image is given
    (LTX2, (), (VIDEO, AUDIO), T.T2VS),
    (LTX2, (IMAGE,), (VIDEO, AUDIO), T.I2V),  # (the family adds the soundtrack to i2v)
    (STABLE_AUDIO, (), (), T.T2A),
    (STABLE_AUDIO, (), (VIDEO,), T.T2A),
    (QWEN2, (), (), T.REASON),
    (COSMOS3, (), (), T.T2V),
    (COSMOS3, (IMAGE,), (VIDEO,), T.I2V),
    (COSMOS3, (), (AUDIO,), T.T2VS),
    (COSMOS3, (IMAGE, Modality.ACTION), (VIDEO,), T.A2W),
    ({T.T2V, T.TI2V}, (), (), T.T2V),
    ({T.T2V, T.TI2V}, (IMAGE,), (), T.TI2V),
    ({T.T2A, T.T2VS}, (), (AUDIO,), T.T2A),  # exactly what is wanted beats a superset
])
def test_preference_order(served, given, wants, expected):
    assert suggest_task(served, given, wants) is expected
    # a pure function of the sets: the order they are passed in does not matter
    for order in itertools.permutations(sorted(served, key=lambda t: t.value)):
        assert suggest_task(order, list(given)[::-1], wants) is expected


def test_every_single_task_model_gets_its_task():
    for task in TaskType:
        given = TASK_IO[task].needs
        assert suggest_task({task}, given) is task
        assert suggest_task({task}) is task  # even missing an input: admission names it


def test_the_order_is_fixed_and_covers_every_task():
    assert PREFERENCE[0] is T.T2V and set(PREFERENCE) == set(TaskType)
    assert PREFERENCE.index(T.T2V) < PREFERENCE.index(T.T2I) < PREFERENCE.index(T.T2A)
    assert fits(T.I2V, {IMAGE}) and not fits(T.I2V) and fits(T.TI2V) and not fits(T.A2W, {IMAGE})
    # nothing served at all: still an answer, the first task that reads what is given
    assert suggest_task((), ()) is T.T2V and suggest_task((), (IMAGE,)) is T.I2V


# -- the same suggestion under any hash seed, on real checkpoints --------------------------

HASH_SEEDS = (0, 1, 2, 3)  # under 0, 1 and 3, next(iter({t2i, i2i})) is i2i (the old Flux bug), under 2 t2i

_PROBE = r"""
import json, sys
import numpy as np
from omniloop.api.cli import _task, build_parser
from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, TaskType
from omniloop.serve.warmup import warmup_request
from omniloop.serve.wire import ServedModel, WireCall, WireError, image_requests, video_request

def http(model):
    try:
        if model.serves_videos:
            return video_request(WireCall(prompt="x"), "r", model).task.value
        if model.serves_images:
            return image_requests(WireCall(prompt="x"), ["r"], model)[0].task.value
        return "refused"
    except WireError as e:
        return f"refused: {e.param}"

found = {}
for name, folder in json.loads(sys.argv[1]).items():
    gen = VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32")
    tasks = frozenset(gen.pipeline.spec.tasks)
    model = ServedModel(name=name, tasks=tasks, defaults=gen.pipeline.defaults)
    found[name] = {
        "order": [t.value for t in tasks],  # set iteration order: what the hash seed changes
        "offline": gen.build_request("x").task.value,
        "offline_image": gen.build_request("x", image=np.zeros((16, 16, 3), np.uint8)).task.value,
        "cli": _task(build_parser().parse_args(["generate", "x", "--model", folder]), gen).value,
        "warmup": warmup_request(DiffusionParams(steps=1), tasks).task.value,
        "http": http(model),
    }
print(json.dumps(found))
"""

EXPECTED = {
    "flux": {"offline": "t2i", "offline_image": "i2i", "cli": "t2i", "warmup": "t2i", "http": "t2i"},
    "wan": {"offline": "t2v", "offline_image": "i2v", "cli": "t2v", "warmup": "t2v", "http": "t2v"},
    "ltx2": {"offline": "t2v", "offline_image": "i2v", "cli": "t2v", "warmup": "t2v", "http": "t2v"},
    "stable_audio": {"offline": "t2a", "offline_image": "i2v", "cli": "t2a", "warmup": "t2a", "http": "refused"},
}


def test_suggested_task_does_not_depend_on_the_hash_seed(flux_dir, wan_t2v_dir, ltx2_dir, stable_audio_dir):
    folders = {"flux": str(flux_dir), "wan": str(wan_t2v_dir), "ltx2": str(ltx2_dir),
               "stable_audio": str(stable_audio_dir)}
    src = Path(__file__).resolve().parents[2] / "src"
    probes = {}
    for seed in HASH_SEEDS:  # one process per seed, run side by side (each loads the four checkpoints)
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        probes[seed] = subprocess.Popen([sys.executable, "-c", _PROBE, json.dumps(folders)], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    runs = {}
    for seed, probe in probes.items():
        out, err = probe.communicate(timeout=600)
        assert probe.returncode == 0, err[-3000:]
        runs[seed] = json.loads(out.strip().splitlines()[-1])
    # the seeds did change the set order (so the old next(iter(tasks)) rule would differ) ...
    assert len({tuple(r["flux"]["order"]) for r in runs.values()}) > 1
    assert len({tuple(r["ltx2"]["order"]) for r in runs.values()}) > 1
    # ... and every front end suggests the same task under each of them
    for seed, found in runs.items():
        for name, expected in EXPECTED.items():
            got = {k: v for k, v in found[name].items() if k != "order"}
            assert got == expected, (seed, name, got)
