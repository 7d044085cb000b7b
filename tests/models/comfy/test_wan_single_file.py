"""Original-layout Wan single files (ComfyUI's ``diffusion_models/`` and ``vae/``) load into our
Wan DiT and VAE with the module state diffusers' ``from_single_file`` gives on the same file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.autoencoders.wan_vae import load_wan_vae, vae_state_dict_from_diffusers
from omniloop.models.autoencoders.wan_vae import load_wan_vae_single_file
from omniloop.models.families.wan.weights import dit_state_dict_from_diffusers, load_wan_dit_single_file
from tests.models.comfy.original_layout import (comfy_quant_fp8, scaled_fp8, wan22_vae_original, wan_dit_original,
                                              wan_vae_original)
from tests.wan_checkpoint import tiny_transformer

diffusers = pytest.importorskip("diffusers")


def _tiny_i2v():
    torch.manual_seed(4)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, image_dim=20, added_kv_proj_dim=24, rope_max_seq_len=32).eval()


def _perturbed(model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms off 1, biases off 0: a swapped key cannot hide
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _assert_same(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(expected)
    bad = [k for k in expected if ours[k].dtype != expected[k].dtype or not torch.equal(ours[k], expected[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_wan_dit_single_file_equals_diffusers_from_single_file(tmp_path, kind):
    model = _perturbed(tiny_transformer(2) if kind == "t2v" else _tiny_i2v())
    model.save_pretrained(tmp_path / "transformer")
    path = tmp_path / f"wan_{kind}.safetensors"
    save_file(wan_dit_original(model.state_dict()), path)
    # the inverse map is right: diffusers reads the file back to the model it came from
    oracle = diffusers.WanTransformer3DModel.from_single_file(str(path), config=str(tmp_path / "transformer"))
    _assert_same(oracle.state_dict(), model.state_dict())

    ours = load_wan_dit_single_file(path, dtype=torch.float32, attention_head_dim=12)
    _assert_same(ours.state_dict(), {k: v for k, v in dit_state_dict_from_diffusers(oracle.state_dict()).items()
                                     if k in ours.state_dict()})
    assert ours.config.num_layers == 2 and ours.config.in_channels == model.config.in_channels
    assert ours.config.image_dim == model.config.image_dim


def test_wan_dit_single_file_wrapped_bf16_and_scaled_fp8(tmp_path):
    model = _perturbed(tiny_transformer(2))
    original = wan_dit_original(model.state_dict())
    # a ComfyUI full checkpoint wraps the DiT keys; bf16 storage loads as bf16 (fp32 where diffusers keeps fp32)
    save_file({f"model.diffusion_model.{k}": v.to(torch.bfloat16) for k, v in original.items()},
              tmp_path / "bf16.safetensors")
    bf16 = load_wan_dit_single_file(tmp_path / "bf16.safetensors", dtype=torch.bfloat16, attention_head_dim=12)
    assert bf16.blocks[0].self_attn.qkv.weight.dtype == torch.bfloat16
    assert bf16.scale_shift_table.dtype == torch.float32  # diffusers' _keep_in_fp32_modules
    expected = torch.cat([original[f"blocks.0.self_attn.{p}.weight"] for p in "qkv"]).to(torch.bfloat16)
    assert torch.equal(bf16.blocks[0].self_attn.qkv.weight, expected)

    fp8 = scaled_fp8(original)
    save_file(fp8, tmp_path / "fp8.safetensors")
    ours = load_wan_dit_single_file(tmp_path / "fp8.safetensors", dtype=torch.float32, attention_head_dim=12)
    dequant = fp8["blocks.1.ffn.0.weight"].float() * fp8["blocks.1.ffn.0.scale_weight"]
    assert torch.equal(ours.blocks[1].ffn.proj_in.weight, dequant)
    assert (dequant - original["blocks.1.ffn.0.weight"]).abs().max() < 0.1 * original["blocks.1.ffn.0.weight"].abs().max()


def test_wan_dit_single_file_mixed_precision_fp8(tmp_path):
    original = wan_dit_original(_perturbed(tiny_transformer(2)).state_dict())
    quant = comfy_quant_fp8(original)
    save_file(quant, tmp_path / "mixed.safetensors")
    ours = load_wan_dit_single_file(tmp_path / "mixed.safetensors", dtype=torch.float32, attention_head_dim=12)
    dequant = quant["blocks.0.cross_attn.o.weight"].float() * quant["blocks.0.cross_attn.o.weight_scale"]
    assert torch.equal(ours.blocks[0].cross_attn.out.weight, dequant)
    save_file(comfy_quant_fp8(original, fmt="mxfp8"), tmp_path / "mxfp8.safetensors")
    with pytest.raises(ValueError, match=r"stored as 'mxfp8'; only fp8 .* and nvfp4"):
        load_wan_dit_single_file(tmp_path / "mxfp8.safetensors", attention_head_dim=12)
    save_file(comfy_quant_fp8(original, fmt="nvfp4"), tmp_path / "nvfp4.safetensors")  # fp8 codes, no weight_scale_2
    with pytest.raises(ValueError, match=r"is marked 'nvfp4' but holds a torch.float8_e4m3fn weight"):
        load_wan_dit_single_file(tmp_path / "nvfp4.safetensors", attention_head_dim=12)


def test_wan_dit_single_file_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="Wan diffusion-model"):
        load_wan_dit_single_file(tmp_path / "nope.safetensors")
    save_file({"foo.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not an original-layout Wan DiT"):
        load_wan_dit_single_file(tmp_path / "other.safetensors")
    original = wan_dit_original(tiny_transformer(2).state_dict())
    save_file(original, tmp_path / "wan.safetensors")
    with pytest.raises(ValueError, match="attention_head_dim=128"):
        load_wan_dit_single_file(tmp_path / "wan.safetensors")  # width 24 is no multiple of 128
    del original["blocks.1.self_attn.k.weight"]
    save_file(original, tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match=r"blocks\.1\.attn1\.to_k\.weight"):
        load_wan_dit_single_file(tmp_path / "broken.safetensors", attention_head_dim=12)


def test_wan_vae_single_file_equals_diffusers_from_single_file(tmp_path):
    torch.manual_seed(1)
    vae = _perturbed(diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                                temperal_downsample=[False, True, True]).eval())
    vae.save_pretrained(tmp_path / "vae")
    path = tmp_path / "wan_2.1_vae.safetensors"
    save_file(wan_vae_original(vae.state_dict()), path)
    oracle = diffusers.AutoencoderKLWan.from_single_file(str(path), config=str(tmp_path / "vae"))
    _assert_same(oracle.state_dict(), vae.state_dict())

    ours = load_wan_vae_single_file(path, dtype=torch.float32)
    _assert_same(ours.state_dict(), vae_state_dict_from_diffusers(oracle.state_dict()))
    folder = load_wan_vae(tmp_path / "vae", dtype=torch.float32)
    _assert_same(ours.state_dict(), folder.state_dict())


def test_wan22_vae_single_file_equals_the_diffusers_folder(tmp_path):
    """The Wan2.2 VAE file (``wan2.2_vae.safetensors``: nested levels, 12 patchified channels,
    48 latent channels). diffusers 0.42's ``from_single_file`` reads only Wan2.1's layout, so
    the oracle is the diffusers model the file was written from (its conversion script
    ``convert_vae_22``'s inverse): same state, so the same encode/decode."""
    from omniloop.models.autoencoders.wan_vae import WAN22_LATENTS_MEAN
    from tests.models.wan.test_ti2v_parity import TINY_VAE22

    torch.manual_seed(1)
    vae = _perturbed(diffusers.AutoencoderKLWan(**{**TINY_VAE22, "num_res_blocks": 2}).eval())
    vae.save_pretrained(tmp_path / "vae")
    path = tmp_path / "wan2.2_vae.safetensors"
    original = wan22_vae_original(vae.state_dict(), num_res_blocks=2)
    assert "encoder.downsamples.1.downsamples.2.time_conv.weight" in original  # the released nesting
    assert "decoder.upsamples.0.upsamples.3.resample.1.weight" in original
    save_file(original, path)

    ours = load_wan_vae_single_file(path, dtype=torch.float32)
    folder = load_wan_vae(tmp_path / "vae", dtype=torch.float32)
    _assert_same(ours.state_dict(), folder.state_dict())
    _assert_same(ours.state_dict(), vae_state_dict_from_diffusers(vae.state_dict()))
    config = ours.config
    assert (config.is_residual, config.patch_size, config.z_dim, config.scale_factor_spatial) == (True, 2, 48, 16)
    assert config.temperal_downsample == (False, True, True) and config.decoder_base_dim == 8
    assert config.latents_mean == WAN22_LATENTS_MEAN  # the released statistics (not in the file)
    with torch.no_grad():
        z = torch.randn(1, 48, 2, 2, 2, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(ours.decode(z), vae.decode(z).sample, rtol=0, atol=1e-5)

    del original["conv2.weight"], original["conv2.bias"]
    save_file({k: v for k, v in original.items()}, tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match="post_quant_conv"):
        load_wan_vae_single_file(tmp_path / "broken.safetensors", dtype=torch.float32)


def test_wan_vace_single_file_equals_diffusers_from_single_file(tmp_path):
    """ComfyUI's Wan VACE file (``vace_blocks.*``, ``vace_patch_embedding``): diffusers'
    ``from_single_file`` reads it back to the model it came from, and ours loads the same
    state as a VACE DiT whose hint layers are the evenly spaced ones of the original code."""
    torch.manual_seed(5)
    model = _perturbed(diffusers.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=16, ffn_dim=32, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=96).eval())
    model.save_pretrained(tmp_path / "transformer")
    path = tmp_path / "wan2.1_vace_tiny.safetensors"
    original = wan_dit_original(model.state_dict())
    assert "vace_blocks.0.before_proj.weight" in original and "vace_blocks.1.after_proj.bias" in original
    save_file(original, path)
    oracle = diffusers.WanVACETransformer3DModel.from_single_file(str(path), config=str(tmp_path / "transformer"))
    _assert_same(oracle.state_dict(), model.state_dict())

    from omniloop.models.families.wan.model import WanVaceDiT

    ours = load_wan_dit_single_file(path, dtype=torch.float32, attention_head_dim=12)
    assert isinstance(ours, WanVaceDiT)
    assert ours.config.vace_layers == (0, 2) and ours.config.vace_in_channels == 96
    _assert_same(ours.state_dict(), dit_state_dict_from_diffusers(oracle.state_dict()))
