"""FLUX.2 from ComfyUI's single files: the BFL-layout DiT (``diffusion_models/flux-2-klein-4b.safetensors``)
loads into our DiT with the module state diffusers' ``Flux2Transformer2DModel.from_single_file``
gives; the LDM-layout VAE with its ``bn.`` statistics (``vae/flux2-vae.safetensors``) and the
Qwen3 file (``text_encoders/qwen_3_4b.safetensors``, transformers' names, with a tokenizer
folder) load too, and the three make the image the diffusers folder makes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.families.flux2.weights import load_flux2_transformer, load_flux2_transformer_single_file
from tests.models.comfy.original_layout import scaled_fp8
from tests.models.flux2.checkpoint import tiny_flux2_transformer
from tests.models.flux2.original_layout import flux2_dit_original

diffusers = pytest.importorskip("diffusers")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


def test_flux2_dit_single_file_equals_diffusers_from_single_file(tmp_path):
    model = tiny_flux2_transformer()
    model.save_pretrained(tmp_path / "transformer")
    path = tmp_path / "flux-2-klein.safetensors"
    save_file(flux2_dit_original(model.state_dict()), path)  # as BFL ships it (diffusers reads no prefix)
    oracle = diffusers.Flux2Transformer2DModel.from_single_file(str(path), config=str(tmp_path / "transformer"))
    _same(oracle.state_dict(), model.state_dict())  # the inverse map is right

    ours = load_flux2_transformer_single_file(path, dtype=torch.float32)  # 16-wide heads: axes (4, 4, 4, 4)
    _same(ours.state_dict(), oracle.state_dict())
    assert ours.config == load_flux2_transformer(tmp_path / "transformer", dtype=torch.float32).config

    # ComfyUI's scaled-fp8 release inside its model.diffusion_model. section
    fp8 = scaled_fp8({f"model.diffusion_model.{k}": v for k, v in flux2_dit_original(model.state_dict()).items()})
    save_file(fp8, tmp_path / "fp8.safetensors")
    quantized = load_flux2_transformer_single_file(tmp_path / "fp8.safetensors", dtype=torch.float32)
    key = "model.diffusion_model.double_blocks.0.txt_attn.qkv"
    assert torch.equal(quantized.transformer_blocks[0].attn.add_k_proj.weight,
                       (fp8[f"{key}.weight"].float() * fp8[f"{key}.scale_weight"]).chunk(3)[1])


def test_a_flux1_file_is_refused_naming_what_to_pass(tmp_path):
    save_file({"img_in.weight": torch.zeros(4, 4)}, tmp_path / "flux1.safetensors")
    with pytest.raises(ValueError, match="not a BFL-layout FLUX.2 DiT .*single_stream_modulation.lin.weight"):
        load_flux2_transformer_single_file(tmp_path / "flux1.safetensors", dtype=torch.float32)


def test_klein_from_a_models_folder_equals_the_diffusers_folder(tmp_path, klein_base_dir):
    """UNETLoader's DiT, VAELoader's flux2-vae.safetensors and CLIPLoader's qwen_3_4b.safetensors
    (+ its tokenizer folder) make the image the klein base folder makes: latents within TOL (the
    two loads differ in where tensors sit in memory: the CPU GEMMs may round another way)."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file import SingleFileSet
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
    from tests.models.flux2.helpers import generator, klein_pipeline
    from tests.models.flux2.original_layout import flux2_vae_original

    pipe = klein_pipeline(klein_base_dir)
    root = tmp_path / "models"
    for folder in ("diffusion_models", "vae", "text_encoders"):
        (root / folder).mkdir(parents=True)
    save_file(flux2_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "klein.safetensors")
    save_file(flux2_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "flux2-vae.safetensors")
    save_file({k: v.clone() for k, v in pipe.text_encoder.state_dict().items()},
              root / "text_encoders" / "qwen_3.safetensors")  # transformers' names under model. (+ lm_head)
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "qwen_3_tokenizer")

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = SingleFileSet(family="flux2", diffusion_models=("klein.safetensors",), vae="flux2-vae.safetensors",
                          text_encoders=("qwen_3.safetensors",), tokenizers=("qwen_3_tokenizer",), vae_norm_groups=4)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    request = OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="a red circle")], outputs=OutputSpec(return_latents=True),
                          diffusion=DiffusionParams(height=32, width=48, steps=2, guidance_scale=4.0, seed=3))
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    folder = generator(klein_base_dir).generate(request)
    assert ours.failure is None and folder.failure is None
    diff = (ours.artifacts["latents"].latents - folder.artifacts["latents"].latents).abs().max()
    assert diff <= 5e-6, diff  # measured: 1.9e-6 (0 when run in another order)
