"""A model that never trained on single frames does not declare T2I, and every surface refuses
an image request for it with a clear message (issue 15: the session-5 shapes models answered
``images.generate`` with empty backgrounds and ``--task t2i`` with an empty dark frame)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from omniloop.api.generator import VideoGenerator
from omniloop.models.loader import BUILTIN_DIR
from omniloop.models.manifest import MANIFEST_FILE
from tests.serve.conftest import live_server


@pytest.fixture(scope="module")
def video_only_student(tmp_path_factory):
    """The shipped student (and the teacher folder whose VAE it reads), declaring t2v alone."""
    root = tmp_path_factory.mktemp("video_only")
    for name in ("shapes-t2v", "shapes-t2v-4step"):
        shutil.copytree(BUILTIN_DIR / name, root / name)
    manifest = root / "shapes-t2v-4step" / MANIFEST_FILE
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tasks": ["t2v"]}))
    return root / "shapes-t2v-4step"


def test_generator_and_cli_refuse_t2i_naming_the_served_tasks(video_only_student, tmp_path):
    gen = VideoGenerator.from_pretrained(video_only_student, device="cpu", cpu_threads=1)
    assert gen.tasks == ["t2v"]
    with pytest.raises(ValueError, match=r"task 't2i' is not served by .*pass one of \['t2v'\]"):
        gen.generate_video("a red circle", task="t2i", num_frames=1, save_video=False)
    proc = subprocess.run([sys.executable, "-m", "omniloop.api.cli", "generate", "a red circle", "--task", "t2i",
                           "--model", str(video_only_student), "--num-frames", "1", "--output", str(tmp_path),
                           "--no-progress", "--cpu-threads", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "task 't2i' is not served" in proc.stderr and "Traceback" not in proc.stderr


def test_server_refuses_images_for_it_with_a_400(video_only_student):
    from openai import BadRequestError

    with live_server(video_only_student, cpu_threads=1) as server:
        models = server.client().models.list()
        assert models.data[0].model_extra["tasks"] == ["t2v"]
        with pytest.raises(BadRequestError, match=r"does not generate images \(tasks: \['t2v'\]\)"):
            server.client().images.generate(prompt="a red circle", n=4, size="128x128")


def test_cli_refuses_t2i_from_the_manifest_before_loading(video_only_student, monkeypatch, capsys, tmp_path):
    """``--task t2i`` for a video-only model is refused from its manifest, before any weight
    loads (a user waits no load for a refusal)."""
    from omniloop.api import cli, generator

    def never(*_, **__):
        raise AssertionError("the weights loaded before the task was checked")

    monkeypatch.setattr(generator.VideoGenerator, "from_pretrained", never)
    args = ["generate", "a red circle", "--task", "t2i", "--output", str(tmp_path / "c.png"), "--no-progress"]
    assert cli.main([*args, "--model", str(video_only_student)]) == 2
    err = capsys.readouterr().err
    assert "--task t2i: task 't2i' is not served by" in err and "(its tasks: ['t2v']); pass --task t2v" in err


@pytest.mark.parametrize("model", ["shapes-t2v", "shapes-t2v-4step"])
def test_the_shipped_pair_declares_t2i(model):
    """Since issue 15's (b1)/(b2) runs the shipped models trained on single frames: both declare
    T2I (the student's image adherence is gated in tests/test_shipped_quality.py)."""
    manifest = json.loads((BUILTIN_DIR / model / MANIFEST_FILE).read_text())
    assert manifest["tasks"] == ["t2v", "t2i"]
