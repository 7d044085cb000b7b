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
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType
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


def test_flux_redux_from_models_folder_equals_diffusers_folder(flux_redux_dir, tmp_path):
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(flux_dit_original(load_file(flux_redux_dir / "transformer" / "diffusion_pytorch_model.safetensors")),
              root / "diffusion_models" / "flux1-dev.safetensors")
    save_file(kl_vae_original(load_file(flux_redux_dir / "vae" / "diffusion_pytorch_model.safetensors"), levels=4),
              root / "vae" / "ae.safetensors")
    for name, sub in (("clip_l", "text_encoder"), ("t5xxl", "text_encoder_2")):
        for file in (flux_redux_dir / sub).iterdir():
            (root / "text_encoders" / name).mkdir(parents=True, exist_ok=True)
            (root / "text_encoders" / name / file.name).write_bytes(file.read_bytes())
        tok = flux_redux_dir / ("tokenizer" if sub == "text_encoder" else "tokenizer_2")
        for file in tok.iterdir():
            (root / "text_encoders" / name / file.name).write_bytes(file.read_bytes())
    _comfy_files(flux_redux_dir, root)
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = SingleFileSet(family="flux", diffusion_models=("flux1-dev.safetensors",), vae="ae.safetensors",
                          text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4,
                          clip_vision=SIGCLIP, clip_vision_heads=2, style_model=REDUX)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    assert pipeline.spec.takes_references
    request = OmniRequest(task=TaskType.T2I, inputs=[ImagePart(data=_image(), role="reference")],
                          diffusion=DiffusionParams(height=32, width=32, steps=2, seed=3),
                          outputs=OutputSpec(return_latents=True))
    ours = VideoGenerator(spec, pipeline, deploy).generate(request).artifacts["latents"].latents
    folder = VideoGenerator.from_pretrained(flux_redux_dir, device="cpu", dtype="float32").generate(
        request).artifacts["latents"].latents
    assert (ours - folder).abs().max() <= TOL, (ours - folder).abs().max()
    with pytest.raises(ValueError, match=r"style_models is given, clip_vision is not"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="flux", diffusion_models=("flux1-dev.safetensors",), vae="ae.safetensors",
            text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4, style_model=REDUX),
            load_options(deploy))
