"""ComfyModels: names resolve inside the models folder only; a missing one names what exists."""

from __future__ import annotations

import os

import pytest

from omniloop.models.comfy_folder import ComfyModelNameRefused, ComfyModelNotFound, ComfyModels


@pytest.fixture
def models(tmp_path):
    root = tmp_path / "models"
    for rel in ("diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors", "unet/flux1-dev.sft",
                "diffusion_models/wan/wan2.2_a14b_high.safetensors", "vae/ae.safetensors", "vae/notes.txt",
                "clip/t5xxl_fp16.safetensors", "text_encoders/umt5-xxl/config.json",
                "text_encoders/umt5-xxl/model.safetensors", "loras/style.safetensors"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "checkpoints").mkdir()
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "secret.safetensors", root / "vae" / "escape.safetensors")
    os.symlink(tmp_path, root / "loras" / "outside")
    os.symlink(root / "vae" / "ae.safetensors", root / "vae" / "ae_link.safetensors")  # inside: fine
    return ComfyModels(root)


def test_list_follows_comfyui_folders(models):
    assert models.list("diffusion_models") == ["flux1-dev.sft", "wan/wan2.2_a14b_high.safetensors",
                                               "wan2.1_t2v_1.3B_fp16.safetensors"]
    assert models.list("vae") == ["ae.safetensors", "ae_link.safetensors"]  # no .txt, no escaping link
    assert models.list("text_encoders") == ["t5xxl_fp16.safetensors", "umt5-xxl"] == models.list("clip")
    assert models.list("loras") == ["style.safetensors"]
    assert models.list("checkpoints") == [] == models.list("upscale_models")


def test_resolve_inside_root(models):
    assert models.resolve("diffusion_models", "wan\\wan2.2_a14b_high.safetensors").name == "wan2.2_a14b_high.safetensors"
    assert models.resolve("unet", "flux1-dev.sft") == models.root / "unet" / "flux1-dev.sft"
    assert models.resolve("text_encoders", "umt5-xxl").is_dir()
    assert models.resolve("vae", "ae_link.safetensors").is_symlink()


@pytest.mark.parametrize("name, reason", [("../secret.safetensors", r"'\.\.'"), ("/etc/passwd", "absolute"),
                                          ("escape.safetensors", "links outside"), ("", "empty")])
def test_escapes_are_refused(models, name, reason):
    with pytest.raises(ComfyModelNameRefused, match=reason) as err:
        models.resolve("vae", name)
    assert (err.value.folder, err.value.name) == ("vae", name)


def test_missing_name_lists_what_exists(models):
    with pytest.raises(ComfyModelNotFound, match=r"vae model 'wan_2.1_vae.safetensors' not found.*ae.safetensors") as err:
        models.resolve("vae", "wan_2.1_vae.safetensors")
    assert err.value.available == ("ae.safetensors", "ae_link.safetensors")
    with pytest.raises(ComfyModelNotFound, match="no model files"):
        models.resolve("checkpoints", "x.safetensors")
    with pytest.raises(ComfyModelNotFound):
        models.resolve("vae", "notes.txt")  # not a weight file
    with pytest.raises(ComfyModelNameRefused, match="links outside"):
        models.resolve("loras", "outside/secret.safetensors")


def test_bad_folder_and_root(models, tmp_path):
    with pytest.raises(ValueError, match="unknown model folder 'vaes'.*'vae'"):
        models.list("vaes")
    with pytest.raises(FileNotFoundError, match="--comfy-models"):
        ComfyModels(tmp_path / "nope")
