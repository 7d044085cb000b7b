"""``omniloop comfy check``: the coverage report of workflow files (exit 1 if one is refused)."""

from __future__ import annotations

import json

import pytest

from omniloop.api.cli import main
from tests.workflows.templates import templates_dir

pytest.importorskip("comfyui_workflow_templates_json")


def test_check_reports_supported_refused_and_the_requests(capsys):
    ok = templates_dir() / "text_to_video_wan.json"
    assert main(["comfy", "check", str(ok)]) == 0
    report = capsys.readouterr().out
    assert "ok  KSampler x1" in report and "result: compiles; 1 request(s)" in report
    assert "task t2v outputs ['video']" in report
    refused = templates_dir() / "video_wan2.1_fun_camera_v1.1_1.3B.json"  # (the VACE templates compile now)
    assert main(["comfy", "check", "--json", str(ok), str(refused)]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in rows] == ["compiles", "refused"]
    assert rows[1]["refused"] == ["WanCameraEmbedding", "WanCameraImageToVideo"]


def test_exact_refuses_deviations_and_models_are_checked(tmp_path, capsys):
    audio = templates_dir() / "audio_stable_audio_example.json"
    assert main(["comfy", "check", str(audio)]) == 0
    report = capsys.readouterr().out  # (its KSampler's dpmpp_3m_sde_gpu / exponential runs as ComfyUI's: comfy_v_*)
    assert "deviation: node 20 (SaveAudioAdvanced): format='flac'" in report and "node 3 (KSampler)" not in report
    assert main(["comfy", "check", "--exact", str(audio)]) == 1
    (tmp_path / "omniloop-models.json").write_text(json.dumps({"served": {"a": {"path": "x"}}, "files": {}}))
    assert main(["comfy", "check", "--models", str(tmp_path), str(audio)]) == 1
    assert "'stable-audio-open-1.0.safetensors' not in checkpoints/" in capsys.readouterr().out
    assert main(["comfy", "check", "--models", str(tmp_path / "nope"), str(audio)]) == 2  # no map file: exit 2


def test_check_resolves_single_files_of_a_models_folder(tmp_path, capsys):
    """A folder of ComfyUI's files and no map: the loader names resolve to its files (here
    Stable Audio Open's checkpoint and t5-base, loaded from single files when served)."""
    audio = templates_dir() / "audio_stable_audio_example.json"
    for folder, name in (("checkpoints", "stable-audio-open-1.0.safetensors"), ("text_encoders", "t5-base.safetensors")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(b"")  # names are checked, not loaded
    assert main(["comfy", "check", "--models", str(tmp_path), str(audio)]) == 0
    assert "request -> model 'checkpoints/stable-audio-open-1.0.safetensors' task t2a" in capsys.readouterr().out
    (tmp_path / "text_encoders" / "t5-base.safetensors").unlink()
    assert main(["comfy", "check", "--models", str(tmp_path), str(audio)]) == 1
    assert "'t5-base.safetensors' not in text_encoders/" in capsys.readouterr().out
