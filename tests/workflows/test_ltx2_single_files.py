"""The LTX-2 templates run from a ComfyUI models folder of single files, as a ComfyUI user holds
LTX-2: ``checkpoints/ltx-2-19b-dev-fp8.safetensors`` (Lightricks' layout: DiT and text
connectors, ``vae.``, ``audio_vae.``, ``vocoder.``, the top-level ``text_embedding_projection.``),
``text_encoders/gemma_3_12B_it_fp4_mixed.safetensors`` (ComfyUI's Gemma 3 layout) with a
tokenizer folder, ``latent_upscale_models/ltx-2-spatial-upscaler-x2-1.0.safetensors``.

The tiny LTX-2 of tests/models/ltx2 is written in that layout; the template is compiled against
the folder (no omniloop-models.json: every loader name is a file there), the pipeline built
from the workflow's loader files (serve/comfy.py's ``single_file_set``, what the ComfyUI API
server builds) and run by our engine; its video and audio equal the same request on the
diffusers folder. Every component's state and config is bit-equal to the folder's
(tests/models/comfy/test_ltx2_single_file.py), and so are the outputs in a process of their own;
under pytest the two loads put the same weights at other alignments and the CPU GEMMs take
other vectorized paths (as tests/models/comfy/test_single_file_pipeline.py says), so the
outputs agree within TOL. Measured: video max |diff| 1/255 on 1.8e-5 of the values, audio
6e-8, latents within TOL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.api.generator import VideoGenerator
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.single_file_pipeline import load_single_file_pipeline
from omniloop.serve.comfy import single_file_set
from omniloop.workflows import ModelFolder, WorkflowError, compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.models.comfy.original_layout import gemma3_comfy, ltx2_checkpoint_original
from tests.workflows.templates import template
from tests.workflows.test_run_templates import input_dir, small  # noqa: F401 (a fixture)

pytest.importorskip("comfyui_workflow_templates_json")
diffusers = pytest.importorskip("diffusers")

CHECKPOINT, GEMMA = "ltx-2-19b-dev-fp8.safetensors", "gemma_3_12B_it_fp4_mixed.safetensors"
DISTILLED = "ltx-2-19b-distilled.safetensors"
UPSCALER, LORA = "ltx-2-spatial-upscaler-x2-1.0.safetensors", "ltx-2-19b-distilled-lora-384.safetensors"
TOL = 5e-6  # as tests/models/comfy/test_single_file_pipeline.py
CONFIG_FILES = ("transformer/config.json", "connectors/config.json", "vae/config.json", "audio_vae/config.json",
                "vocoder/config.json", "text_encoder/config.json", "latent_upsampler/config.json",
                "scheduler/scheduler_config.json")


def ltx2_models_folder(root: Path, ltx2: Path) -> Path:
    """``ltx2`` (a diffusers LTX-2 folder) as the files of ComfyUI's LTX-2 templates."""
    from transformers import Gemma3ForConditionalGeneration

    for sub in ("checkpoints", "text_encoders", "latent_upscale_models", "loras"):
        (root / sub).mkdir(parents=True)
    save_file(ltx2_checkpoint_original(ltx2), root / "checkpoints" / CHECKPOINT)
    (root / "checkpoints" / DISTILLED).hardlink_to(root / "checkpoints" / CHECKPOINT)  # the distilled template's name
    gemma = Gemma3ForConditionalGeneration.from_pretrained(ltx2 / "text_encoder", dtype=torch.float32)
    save_file(gemma3_comfy(gemma.state_dict()), root / "text_encoders" / GEMMA)
    shutil.copytree(ltx2 / "tokenizer", root / "text_encoders" / "gemma_3_12B_it_fp4_mixed_tokenizer")
    upsampler = ltx2 / "latent_upsampler"
    config = {k: v for k, v in json.loads((upsampler / "config.json").read_text()).items() if not k.startswith("_")}
    save_file(load_file(upsampler / "diffusion_pytorch_model.safetensors"), root / "latent_upscale_models" / UPSCALER,
              metadata={"config": json.dumps(config)})  # as Lightricks ships it (ComfyUI reads it)
    save_file({"unused": torch.zeros(1)}, root / "loras" / LORA)  # the refine stage's LoRA: named, not run
    return root


def configs_folder(folder: Path, ltx2: Path) -> Path:
    """The tiny model's architecture facts (its config files, no weights): the released
    LTX-2.0 configs are the defaults, a tiny model needs its own."""
    for name in CONFIG_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ltx2 / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def models(ltx2_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = ltx2_models_folder(tmp_path_factory.mktemp("comfy_ltx2"), ltx2_dir)
    return root, configs_folder(tmp_path_factory.mktemp("ltx2_configs"), ltx2_dir)


def compiled(name: str, root: Path, input_dir: Path):
    return compile_workflow(small(ui_to_api(template(name))), ModelFolder.load(root), input_dir=input_dir)


@pytest.mark.parametrize("name,checkpoint,two_stage", [("video_ltx2_t2v", CHECKPOINT, True),
                                                      ("video_ltx2_t2v_distilled", DISTILLED, True),
                                                      ("video_ltx2_i2v", CHECKPOINT, False)])
def test_ltx2_templates_from_single_files_equal_the_diffusers_folder(name, checkpoint, two_stage, models, ltx2_dir,
                                                                     input_dir):
    root, configs = models
    workflow = compiled(name, root, input_dir)
    (generation,) = workflow.generations
    assert generation.served.single_file == ("checkpoints", checkpoint)
    files = single_file_set(workflow, generation, ComfyModels(root), {"configs": configs})
    assert (files.family, files.checkpoint, files.text_encoders, files.tokenizers, files.latent_upsampler) == \
        ("ltx2", checkpoint, (GEMMA,), ("gemma_3_12B_it_fp4_mixed_tokenizer",), UPSCALER)

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    assert spec.family == "ltx2" and bool(generation.request.node_params) == two_stage
    request = generation.request.model_copy(update={"model": None})
    request = request.model_copy(update={"outputs": request.outputs.model_copy(update={"return_latents": True})})
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    with VideoGenerator.from_pretrained(str(ltx2_dir), device="cpu", dtype="float32") as gen:
        folder = gen.generate(request)
    assert ours.failure is None and folder.failure is None, (ours.failure, folder.failure)
    for name in ("latents", "audio_latents"):
        got, want = ours.artifacts[name].latents, folder.artifacts[name].latents
        assert got.shape == want.shape and (got - want).abs().max() <= TOL, (name, (got - want).abs().max())
    video, want_video = ours.artifacts["video"].frames, folder.artifacts["video"].frames
    audio, want_audio = ours.artifacts["audio"].samples, folder.artifacts["audio"].samples
    diff = (video.int() - want_video.int()).abs()
    print(f"video max |diff| {int(diff.max())}/255 on {float((diff > 0).float().mean()):.2e} of the values; "
          f"audio max |diff| {float((audio - want_audio).abs().max()):.2e}")
    size = (128, 128) if two_stage else (64, 64)  # the refine stage doubles the base stage's size
    assert tuple(video.shape[:3]) == (9, *size) and int(diff.max()) <= 1 and (diff > 0).float().mean() < 1e-3
    assert audio.shape == want_audio.shape and audio.numel() > 0 and (audio - want_audio).abs().max() <= TOL


def test_ltx2_single_file_bad_input(models, tmp_path):
    root, configs = models
    workflow = compiled("video_ltx2_t2v", root, tmp_path)  # (t2v reads no input image)
    (generation,) = workflow.generations
    deploy = load_options(DeployConfig.from_options(None, device="cpu", dtype="float32"))
    files = single_file_set(workflow, generation, ComfyModels(root), {"configs": configs})
    # a checkpoint lacking a section: named, with the file
    broken = tmp_path / "models"
    shutil.copytree(root, broken, ignore=shutil.ignore_patterns("checkpoints"))
    (broken / "checkpoints").mkdir()
    full = load_file(root / "checkpoints" / CHECKPOINT)
    save_file({k: v for k, v in full.items() if not k.startswith("audio_vae.")}, broken / "checkpoints" / CHECKPOINT)
    with pytest.raises(ValueError, match=rf"{CHECKPOINT}: no 'audio_vae.' section \(the audio VAE\)"):
        load_single_file_pipeline(ComfyModels(broken), files, deploy)
    # the audio VAE / text encoder loader names another checkpoint than the model's
    (root / "checkpoints" / "other.safetensors").hardlink_to(root / "checkpoints" / CHECKPOINT)
    try:
        for loader, part in (("LTXVAudioVAELoader", "audio VAE"), ("LTXAVTextEncoderLoader", "text connectors")):
            api = small(ui_to_api(template("video_ltx2_t2v")))
            nid = next(nid for nid, n in api.items() if n["class_type"] == loader)
            api[nid]["inputs"]["ckpt_name"] = "other.safetensors"
            other = compile_workflow(api, ModelFolder.load(root), input_dir=tmp_path)
            with pytest.raises(WorkflowError, match=f"the {part} come from the checkpoint the model loads") as e:
                single_file_set(other, other.generations[0], ComfyModels(root))
            assert e.value.to_comfy()["node_errors"][nid]["class_type"] == loader
    finally:
        (root / "checkpoints" / "other.safetensors").unlink()
