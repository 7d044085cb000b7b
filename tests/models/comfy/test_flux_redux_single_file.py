"""FLUX.1 Redux from a ComfyUI models folder: ``clip_vision/sigclip_vision_patch14_384.safetensors``
(a transformers ``SiglipVisionModel`` state under ``vision_model.``) and
``style_models/flux1-redux-dev.safetensors`` (``redux_up.*`` / ``redux_down.*``), beside the Flux
single files. Oracles: transformers' ``SiglipVisionModel`` + ``SiglipImageProcessor`` on the same
weights (the tower's output bit-equal), and the diffusers-layout folder's variation (itself tied
to diffusers' FluxPriorReduxPipeline + FluxPipeline in tests/models/flux/test_redux.py), within
TOL as tests/models/comfy/test_single_file_pipeline.py (other file offsets, other GEMM paths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.api.generator import VideoGenerator
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.families.flux.redux import load_siglip_single_file
from omniloop.models.single_file import SingleFileSet
from omniloop.models.single_file_pipeline import load_single_file_pipeline
from omniloop.request import OutputSpec
from tests.models.comfy.original_layout import flux_dit_original, kl_vae_original

TOL = 5e-6
SIGCLIP, REDUX = "sigclip_vision_patch14_384.safetensors", "flux1-redux-dev.safetensors"


def _image(seed=4):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (44, 60, 3), dtype=np.uint8))


def _comfy_files(folder, root):
    """ComfyUI's two Redux files from the diffusers-layout folder's weights."""
    (root / "clip_vision").mkdir(parents=True, exist_ok=True)
    (root / "style_models").mkdir(exist_ok=True)
    tower = load_file(folder / "image_encoder" / "model.safetensors")
    save_file({("" if k.startswith("vision_model.") else "vision_model.") + k: v.clone() for k, v in tower.items()},
              root / "clip_vision" / SIGCLIP)
    embedder = load_file(folder / "image_embedder" / "diffusion_pytorch_model.safetensors")
    save_file({k: v.clone() for k, v in embedder.items()}, root / "style_models" / REDUX)


def test_sigclip_file_equals_transformers_siglip(flux_redux_dir, tmp_path):
    from transformers import SiglipImageProcessor, SiglipVisionModel

    _comfy_files(flux_redux_dir, tmp_path)
    ours = load_siglip_single_file(tmp_path / "clip_vision" / SIGCLIP, device="cpu", dtype=torch.float32,
                                   num_attention_heads=2)
    ref = SiglipVisionModel.from_pretrained(flux_redux_dir / "image_encoder").eval()
    processor = SiglipImageProcessor.from_pretrained(flux_redux_dir / "feature_extractor")
    pixels = processor.preprocess(images=[_image()], do_resize=True, return_tensors="pt", do_convert_rgb=True)
    with torch.no_grad():
        want = ref(**pixels).last_hidden_state
    assert torch.equal(ours.encode([_image()]), want)
    with pytest.raises(ValueError, match="not a SigLIP vision tower"):
        load_siglip_single_file(tmp_path / "style_models" / REDUX, device="cpu", dtype=torch.float32)


def test_redux_template_from_single_files_equals_the_diffusers_folder(flux_redux_dir, tmp_path):
    """flux_redux_model_example served from single files (its loaders' names; the text encoders
    as transformers folders, the sizes shrunk): the ComfyUI server's file set (serve/comfy.py's
    ``single_file_set``) builds the Redux components from the SigLIP and style model files."""
    from omniloop.serve.comfy import single_file_set
    from omniloop.workflows import ModelFolder, compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template
    from tests.workflows.test_run_templates import small

    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(flux_dit_original(load_file(flux_redux_dir / "transformer" / "diffusion_pytorch_model.safetensors")),
              root / "diffusion_models" / "flux1-dev.safetensors")
    save_file(kl_vae_original(load_file(flux_redux_dir / "vae" / "diffusion_pytorch_model.safetensors"), levels=4),
              root / "vae" / "ae.safetensors")
    for name, subs in (("clip_l", ("text_encoder", "tokenizer")), ("t5xxl", ("text_encoder_2", "tokenizer_2"))):
        (root / "text_encoders" / name).mkdir(parents=True)
        for file in (f for sub in subs for f in (flux_redux_dir / sub).iterdir()):
            (root / "text_encoders" / name / file.name).write_bytes(file.read_bytes())
    _comfy_files(flux_redux_dir, root)
    inputs = tmp_path / "input"
    inputs.mkdir()
    for n in (1, 2):
        _image(n).save(inputs / f"flux_redux_model_example_reference_image_{n}.png")
    api = small(ui_to_api(template("flux_redux_model_example")))
    for node in api.values():
        if node["class_type"] == "DualCLIPLoader":  # the text encoders as transformers folders
            node["inputs"].update(clip_name1="clip_l", clip_name2="t5xxl")
        if node["class_type"] == "BasicScheduler":
            node["inputs"]["steps"] = 2
    workflow = compile_workflow(api, ModelFolder.load(root), input_dir=inputs)
    (generation,) = workflow.generations
    files = single_file_set(workflow, generation, ComfyModels(root),
                            {"rope_axes": (4, 6, 6), "vae_norm_groups": 4, "clip_vision_heads": 2})
    assert (files.clip_vision, files.style_model) == (SIGCLIP, REDUX)
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    assert pipeline.spec.takes_references
    request = generation.request.model_copy(update={"model": None, "outputs": OutputSpec(return_latents=True)})
    assert len(request.images("reference")) == 2 and request.node_params["redux"]["combine"] == "concat"
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    folder = VideoGenerator.from_pretrained(flux_redux_dir, device="cpu", dtype="float32").generate(request)
    assert ours.failure is None and folder.failure is None, (ours.failure, folder.failure)
    got, want = ours.artifacts["latents"].latents, folder.artifacts["latents"].latents
    assert got.shape == (1, 4, 4, 4) and (got - want).abs().max() <= TOL, (got - want).abs().max()
    with pytest.raises(ValueError, match=r"style_models is given, clip_vision is not"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="flux", diffusion_models=("flux1-dev.safetensors",), vae="ae.safetensors",
            text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4, style_model=REDUX),
            load_options(deploy))
