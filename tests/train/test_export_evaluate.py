"""Export to the manifest layout, load back through the user API, evaluate adherence, and fail
cleanly on missing or corrupt shipped weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import av
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.models.loader import BUILTIN_DIR, BUILTIN_MODELS, INTERACTIVE_MODEL
from omniloop.models.manifest import MANIFEST_FILE, read_manifest
from omniloop.train.recipes import evaluate as evaluate_module
from omniloop.train.recipes.export import export_shapes
from omniloop.train.recipes.shapes_dit import DiTRecipe
from omniloop.train.recipes.shapes_model import STUDENT_NAME, TEACHER_NAME


@pytest.fixture(scope="module")
def exported(toy_chain, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    report = export_shapes(toy_chain, out, DiTRecipe.toy().model)
    return out, report


def _frames(path):
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(c.streams.video[0])), c.streams.video[0].codec_context.name


def test_exported_models_load_through_the_video_generator_and_write_mp4s(exported, tmp_path):
    out, report = exported
    assert report.total_bytes == sum(
        p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    teacher = read_manifest(out / TEACHER_NAME)
    assert teacher.components["text_encoder"].kind == "minilm" and teacher.defaults["steps"] == 3
    # bf16 weights, except the DiT tensors the loader keeps in fp32
    from safetensors import safe_open

    with safe_open(str(out / TEACHER_NAME / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == "BF16" and dtypes["blocks.0.scale_shift_table"] == "F32"

    gen = VideoGenerator.from_pretrained(out / TEACHER_NAME, device="cpu")
    assert gen.pipeline.spec.node("decode").stage.whole is None  # short clips decode as one chunk
    result = gen.generate_video("a red circle moving right", seed=1, output_path=tmp_path / "teacher.mp4")
    assert result.frames.shape == (5, 32, 32, 3) and result.metrics.steps == 3  # the manifest's defaults
    assert _frames(result.path) == (5, "h264")

    student = VideoGenerator.from_pretrained(out / STUDENT_NAME, device="cpu")
    assert student.pipeline.components["sampler"].default == "flow_euler"
    fast = student.generate_video("a blue square moving left", seed=1, output_path=tmp_path / "student.mp4")
    assert fast.metrics.steps == 2 and _frames(fast.path)[0] == 5  # its fixed sigmas, one forward each
    assert student.generate_video("x", seed=1, steps=3, save_video=False).metrics.steps == 3  # still overridable


def test_teacher_ships_alone_before_a_student_exists(toy_chain, tmp_path):
    from omniloop.train.recipes.export import install

    work = tmp_path / "work"  # the chain without its distillation stage
    for stage in ("vae", "dit"):
        shutil.copytree(toy_chain / stage, work / stage)
    with pytest.raises(FileNotFoundError, match="distill"):
        export_shapes(work, tmp_path / "both", DiTRecipe.toy().model)
    report = export_shapes(work, tmp_path / "out", DiTRecipe.toy().model, student=False)
    assert set(report.models) == {TEACHER_NAME} and not (tmp_path / "out" / STUDENT_NAME).exists()
    builtin = tmp_path / "builtin"
    shutil.copytree(BUILTIN_DIR / STUDENT_NAME, builtin / STUDENT_NAME)  # what is there is left alone
    assert install(tmp_path / "out", builtin) == [builtin / TEACHER_NAME]
    assert read_manifest(builtin / STUDENT_NAME).files == read_manifest(BUILTIN_DIR / STUDENT_NAME).files
    gen = VideoGenerator.from_pretrained(builtin / TEACHER_NAME, device="cpu")
    assert gen.generate_video("a red circle", seed=1, save_video=False).frames.shape == (5, 32, 32, 3)


def test_export_refuses_models_over_the_package_budget(toy_chain, tmp_path):
    with pytest.raises(ValueError, match=r"MB, over the 0 MB package budget"):
        export_shapes(toy_chain, tmp_path, DiTRecipe.toy().model, budget_bytes=1000)


def test_evaluate_reports_per_attribute_adherence_as_json(exported, tmp_path):
    out, _ = exported
    result = evaluate_module.evaluate_model(out / STUDENT_NAME, n=3, seed=0, device="cpu", max_batch=2,
                                            videos_dir=tmp_path / "videos")
    assert result["n"] == 3 and result["steps"] == 2
    assert set(result["adherence"]) == {"color", "shape", "motion", "count", "stable", "prompt_correct",
                                        "all_correct", "n"}
    assert result["report"]["n_clips"] == 3 and "confusion" in result["report"]
    # stability per frame index (5 frames at toy size), and prompts by object count
    assert len(result["stability"]["failing_by_frame"]) == 5 and 0 <= result["stability"]["stable"] <= 1
    assert set(result["by_objects"]) <= {"1", "2"} and sum(g["clips"] for g in result["by_objects"].values()) == 3
    # the toy student serves T2V only (no image trajectories): images are skipped, saying why
    extra = evaluate_module.evaluate_model(out / STUDENT_NAME, n=1, device="cpu", images=2, two_objects=2)
    assert "does not declare t2i" in extra["images"]["skipped"]
    assert extra["two_objects"]["n"] == 2 and extra["two_objects"]["clips"] == 2
    json.dumps(result, default=str)
    # the written videos are what `omniloop eval adherence` reads
    rows = [json.loads(line) for line in (tmp_path / "videos" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and (tmp_path / "videos" / rows[0]["video"]).is_file()

    target = tmp_path / "report.json"
    assert evaluate_module.main(["--model", str(out / TEACHER_NAME), "--n", "2", "--device", "cpu",
                                 "--output", str(target)]) == 0
    assert json.loads(target.read_text())["report"]["n_clips"] == 2


def test_missing_or_corrupt_weights_fail_naming_the_file(exported, tmp_path):
    out, _ = exported
    model = tmp_path / "models"
    shutil.copytree(out, model)
    weights = model / TEACHER_NAME / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=rf"{weights}.* is truncated or corrupt"):
        VideoGenerator.from_pretrained(model / TEACHER_NAME, device="cpu")
    weights.write_bytes(data[:-4] + b"\0\0\0\0")  # same size, other bytes
    with pytest.raises(ValueError, match=rf"{weights}.* is corrupt: its sha256"):
        VideoGenerator.from_pretrained(model / TEACHER_NAME, device="cpu")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{weights} is missing"):
        VideoGenerator.from_pretrained(model / TEACHER_NAME, device="cpu")
    # the student reads the teacher's VAE: its damage is named too
    vae = model / TEACHER_NAME / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{vae}.* is truncated"):
        VideoGenerator.from_pretrained(model / STUDENT_NAME, device="cpu")
    # a manifest without file records (hand-assembled): the safetensors header check names the file
    manifest = json.loads((model / STUDENT_NAME / MANIFEST_FILE).read_text())
    manifest["files"] = {}
    (model / STUDENT_NAME / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"{vae} is not a readable safetensors file"):
        VideoGenerator.from_pretrained(model / STUDENT_NAME, device="cpu")


def _cli_generate(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omniloop.api.cli", "generate", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_built_in_models_are_trained_weights_or_placeholders_that_say_so(tmp_path):
    assert set(BUILTIN_MODELS) - {INTERACTIVE_MODEL} == {TEACHER_NAME, STUDENT_NAME}
    for name, folder in BUILTIN_MODELS.items():
        assert folder.parent == BUILTIN_DIR and read_manifest(folder).name == name
        if not read_manifest(folder).files:  # no fake or random weights: trained ones arrive from the GPU runs
            with pytest.raises(FileNotFoundError, match=rf"{name}/transformer/config.json is missing"):
                VideoGenerator.from_pretrained(name, device="cpu")
            proc = _cli_generate("a red circle moving right", "--model", name, cwd=tmp_path)
            assert proc.returncode == 2 and f"{name}/transformer/config.json is missing" in proc.stderr
            assert "Traceback" not in proc.stderr
    assert read_manifest(BUILTIN_MODELS[TEACHER_NAME]).files, "the embedded default ships trained weights"


def test_a_placeholder_model_fails_naming_its_missing_file(tmp_path):
    """A manifest whose weights are not there (a build without them, a deleted file) is an
    error naming the file, in the API and the CLI (exit 2, no traceback)."""
    model = tmp_path / "placeholder"
    model.mkdir()
    raw = json.loads((BUILTIN_MODELS[STUDENT_NAME] / MANIFEST_FILE).read_text())
    (model / MANIFEST_FILE).write_text(json.dumps({**raw, "files": {}}))
    with pytest.raises(FileNotFoundError, match=r"placeholder/transformer/config.json is missing"):
        VideoGenerator.from_pretrained(model, device="cpu")
    proc = _cli_generate("a red circle moving right", "--model", str(model), cwd=tmp_path)
    assert proc.returncode == 2 and "placeholder/transformer/config.json is missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_shipped_student_generates_in_four_single_forward_steps():
    """``shapes-t2v-4step`` by name: its manifest's sampler, sigmas and guidance 1 (four
    transformer calls), the teacher's VAE read through the shared folder."""
    gen = VideoGenerator.from_pretrained(STUDENT_NAME, device="cpu")
    out = gen.generate_video("a green triangle moving up", seed=3, save_video=False)
    assert out.metrics.steps == 4 and out.frames.shape == (17, 128, 128, 3)
    assert out.frames.std() > 5  # a picture, not a flat field


def test_readme_main_command_writes_a_decodable_video_with_the_embedded_default(tmp_path):
    """``omniloop generate "a red circle moving right"``: no --model, a fresh process, the
    shipped weights (checked against their manifest sha256), an H.264 mp4 PyAV decodes."""
    proc = _cli_generate("a red circle moving right", "--output", "out.mp4", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _frames(tmp_path / "out.mp4") == (17, "h264")
    with av.open(str(tmp_path / "out.mp4")) as c:
        frame = next(c.decode(c.streams.video[0])).to_ndarray(format="rgb24")
    assert frame.shape == (128, 128, 3) and frame.std() > 5  # a picture, not a flat field


def test_bad_manifests_are_clear_errors(tmp_path, exported):
    out, _ = exported
    model = tmp_path / "m"
    shutil.copytree(out / TEACHER_NAME, model)
    raw = json.loads((model / MANIFEST_FILE).read_text())
    (model / MANIFEST_FILE).write_text(json.dumps({**raw, "schema_version": 9}))
    with pytest.raises(ValueError, match=r"omniloop_model.json is not a valid .*schema_version 9 is not supported"):
        VideoGenerator.from_pretrained(model, device="cpu")
    bad_text = {**raw, "components": {**raw["components"], "text_encoder": {"kind": "clip"}}}
    (model / MANIFEST_FILE).write_text(json.dumps(bad_text))
    with pytest.raises(ValueError, match=r"text encoder kind 'clip' is not supported; pass one of \['minilm'\]"):
        VideoGenerator.from_pretrained(model, device="cpu")
    bad_vae = {**raw, "components": {**raw["components"], "vae": {**raw["components"]["vae"], "kind": "KL2D"}}}
    (model / MANIFEST_FILE).write_text(json.dumps(bad_vae))  # the family's VAE kinds, not one manifest.py names
    with pytest.raises(ValueError, match=r"vae kind 'KL2D' is not supported; pass one of \['WanVAE'\]"):
        VideoGenerator.from_pretrained(model, device="cpu")
    (model / MANIFEST_FILE).write_text(json.dumps({**raw, "defaults": {**raw["defaults"], "stepz": 3}}))
    with pytest.raises(ValueError, match=r"unknown defaults \['stepz'\]"):
        VideoGenerator.from_pretrained(model, device="cpu")
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    (model / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"preloaded components \['tokenizer'\] are not components"):
        load_pipeline(model, LoadOptions(device=torch.device("cpu"), dtype=torch.float32), preloaded={"tokenizer": 1})
