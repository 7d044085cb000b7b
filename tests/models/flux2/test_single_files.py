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
