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
from omniloop.request import OutputSpec
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


def test_the_klein_template_from_single_files_equals_the_diffusers_folder(tmp_path, klein_base_dir):
    """image_flux2_klein_text_to_image served from a ComfyUI models folder holding its own file
    names: UNETLoader's BFL DiT, VAELoader's flux2-vae.safetensors (LDM layout + bn.), CLIPLoader's
    qwen_3_4b.safetensors (transformers' names) with its tokenizer folder beside it; the family is
    CLIPLoader's type (flux2). Its image equals the klein base folder's: latents within 5e-6 (the
    two loads put the tensors at other addresses: the CPU GEMMs may round another way)."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from omniloop.serve.comfy import single_file_set
    from omniloop.workflows import ModelFolder, compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.models.flux2.helpers import generator, klein_pipeline
    from tests.models.flux2.original_layout import flux2_vae_original
    from tests.workflows.templates import template
    from tests.workflows.test_run_templates import small

    pipe = klein_pipeline(klein_base_dir)
    root = tmp_path / "models"
    for folder in ("diffusion_models", "vae", "text_encoders"):
        (root / folder).mkdir(parents=True)
    save_file(flux2_dit_original(pipe.transformer.state_dict()),
              root / "diffusion_models" / "flux-2-klein-base-4b.safetensors")
    save_file(flux2_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "flux2-vae.safetensors")
    save_file({k: v.clone() for k, v in pipe.text_encoder.state_dict().items()},  # model.* (+ the tied lm_head)
              root / "text_encoders" / "qwen_3_4b.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "qwen_3_4b_tokenizer")

    workflow = compile_workflow(small(ui_to_api(template("image_flux2_klein_text_to_image"))), ModelFolder.load(root))
    (generation,) = workflow.generations
    assert generation.served.single_file == ("diffusion_models", "flux-2-klein-base-4b.safetensors")
    files = single_file_set(workflow, generation, ComfyModels(root), {"vae_norm_groups": 4})
    assert (files.family, files.text_encoders, files.tokenizers) == ("flux2", ("qwen_3_4b.safetensors",),
                                                                      ("qwen_3_4b_tokenizer",))
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    request = generation.request.model_copy(update={"model": None, "outputs": OutputSpec(return_latents=True)})
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    folder = generator(klein_base_dir).generate(request)
    assert ours.failure is None and folder.failure is None, (ours.failure, folder.failure)
    diff = (ours.artifacts["latents"].latents - folder.artifacts["latents"].latents).abs().max()
    assert diff <= 5e-6, diff  # measured: 0 to 1.9e-6 from run to run
