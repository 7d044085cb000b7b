"""A FLUX.1 Canny/Depth DiT as ComfyUI users hold it (``flux1-canny-dev.safetensors``, BFL
layout, in diffusion_models/): the single-file pipeline is told the control variant by the
DiT's in_channels (twice its out_channels; the file names no pipeline class), and generates
under a control image what the diffusers folder of the same weights gives (within TOL, as
tests/models/comfy/test_single_file_pipeline.py: other file offsets, other GEMM paths)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from omniloop.api.generator import VideoGenerator
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.single_file import SingleFileSet
from omniloop.models.single_file_pipeline import load_single_file_pipeline
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.comfy.original_layout import flux_dit_original, kl_vae_original
from tests.models.flux.test_control import _edges

TOL = 5e-6


def test_canny_dit_file_serves_the_control_variant(flux_control_dir, tmp_path):
    import diffusers

    pipe = diffusers.FluxControlPipeline.from_pretrained(flux_control_dir, torch_dtype=torch.float32)
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(flux_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "flux1-canny-dev.safetensors")
    save_file(kl_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "ae.safetensors")
    for name, encoder, tokenizer in (("clip_l", pipe.text_encoder, pipe.tokenizer),
                                     ("t5xxl", pipe.text_encoder_2, pipe.tokenizer_2)):
        encoder.save_pretrained(root / "text_encoders" / name)
        tokenizer.save_pretrained(root / "text_encoders" / name)
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    model = SingleFileSet(family="flux", diffusion_models=("flux1-canny-dev.safetensors",), vae="ae.safetensors",
                          text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), model, load_options(deploy))
    assert pipeline.spec.name == "flux.1-control" and pipeline.spec.takes_control
    request = OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="a red circle"), ImagePart(data=_edges(),
                                                                                              role="control")],
                          diffusion=DiffusionParams(height=32, width=48, steps=2, guidance_scale=30.0, seed=3),
                          outputs=OutputSpec(return_latents=True))
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    folder = VideoGenerator.from_pretrained(flux_control_dir, device="cpu", dtype="float32").generate(request)
    assert ours.failure is None and folder.failure is None
    err = (ours.artifacts["latents"].latents - folder.artifacts["latents"].latents).abs().max()
    assert err <= TOL, err
