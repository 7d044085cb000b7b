"""BFL-layout FLUX.1 single files (``flux1-dev.safetensors``, ComfyUI's ``diffusion_models/``)
load into our Flux DiT with the module state diffusers' ``from_single_file`` gives."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.families.flux.weights import load_flux_transformer, load_flux_transformer_single_file
from tests.flux_checkpoint import tiny_flux_transformer
from tests.models.comfy.original_layout import flux_dit_original, scaled_fp8

diffusers = pytest.importorskip("diffusers")

# diffusers' converter splits single_blocks.{i}.linear1 at FLUX.1's widths (3072 x 3, 12288);
# at toy width the same split is (inner x 3, 4 inner): everything else is diffusers' own code.
_FLUX1_SPLIT = (3072, 3072, 3072, 12288)


def _toy_split(real_split):
    def split(tensor, sizes, dim=0):
        if isinstance(sizes, tuple) and sizes == _FLUX1_SPLIT:
            inner = tensor.shape[dim] // 7
            sizes = (inner, inner, inner, 4 * inner)
        return real_split(tensor, sizes, dim)
    return split


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


@pytest.mark.parametrize("guidance,fill", [(True, False), (False, False), (True, True)],
                         ids=["dev", "schnell", "fill"])
def test_flux_dit_single_file_equals_diffusers_from_single_file(tmp_path, monkeypatch, guidance, fill):
    """FLUX.1 dev (and Kontext dev: the same architecture), schnell, and Fill dev (in_channels
    4 x 16 + 4 x 16 + 256: the masked image and the packed mask beside the latents)."""
    model = tiny_flux_transformer(guidance_embeds=guidance, fill=fill)
    model.save_pretrained(tmp_path / "transformer")
    path = tmp_path / "flux1.safetensors"
    save_file(flux_dit_original(model.state_dict()), path)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "split", _toy_split(torch.split))
        oracle = diffusers.FluxTransformer2DModel.from_single_file(str(path), config=str(tmp_path / "transformer"))
    _same(oracle.state_dict(), model.state_dict())  # the inverse map is right

    ours = load_flux_transformer_single_file(path, dtype=torch.float32, axes_dims_rope=(4, 6, 6))
    _same(ours.state_dict(), {k: v for k, v in oracle.state_dict().items() if k in ours.state_dict()})
    _same(ours.state_dict(), load_flux_transformer(tmp_path / "transformer", dtype=torch.float32).state_dict())
    assert ours.config.guidance_embeds is guidance
    assert ours.config.in_channels == oracle.config.in_channels == model.config.in_channels


def test_flux_dit_single_file_scaled_fp8_and_bad_input(tmp_path):
    original = flux_dit_original(tiny_flux_transformer().state_dict())
    fp8 = scaled_fp8({f"model.diffusion_model.{k}": v for k, v in original.items()})
    save_file(fp8, tmp_path / "fp8.safetensors")
    ours = load_flux_transformer_single_file(tmp_path / "fp8.safetensors", dtype=torch.float32, axes_dims_rope=(4, 6, 6))
    key = "model.diffusion_model.double_blocks.0.img_attn.qkv"
    q = (fp8[f"{key}.weight"].float() * fp8[f"{key}.scale_weight"]).chunk(3)[0]
    assert torch.equal(ours.transformer_blocks[0].attn.to_q.weight, q)

    with pytest.raises(ValueError, match="pass axes_dims_rope"):
        load_flux_transformer_single_file(tmp_path / "fp8.safetensors")
    save_file({"x.weight": torch.zeros(1)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="not a BFL-layout Flux DiT"):
        load_flux_transformer_single_file(tmp_path / "x.safetensors")


def test_flux_ae_single_file_equals_diffusers_from_single_file(tmp_path):
    from omniloop.models.autoencoders.kl2d import load_kl2d_vae
    from omniloop.models.families.flux.weights import load_flux_ae_single_file
    from tests.flux_checkpoint import tiny_kl_vae
    from tests.models.comfy.original_layout import kl_vae_original

    vae = tiny_kl_vae()
    vae.save_pretrained(tmp_path / "vae")
    path = tmp_path / "ae.safetensors"
    save_file(kl_vae_original(vae.state_dict(), levels=4), path)
    oracle = diffusers.AutoencoderKL.from_single_file(str(path), config=str(tmp_path / "vae"))
    _same(oracle.state_dict(), vae.state_dict())

    ours = load_flux_ae_single_file(path, norm_num_groups=4)
    _same(ours.state_dict(), load_kl2d_vae(tmp_path / "vae").state_dict())
    _same(ours.state_dict(), {k: v for k, v in oracle.state_dict().items() if k in ours.state_dict()})
    assert (ours.config.scaling_factor, ours.config.shift_factor) == (0.3611, 0.1159)
    # inside a full checkpoint the VAE sits under first_stage_model. (or vae.), beside other components
    save_file({**{f"first_stage_model.{k}": v for k, v in kl_vae_original(vae.state_dict(), 4).items()},
               "model.diffusion_model.img_in.weight": torch.zeros(2, 2)}, tmp_path / "full.safetensors")
    _same(load_flux_ae_single_file(tmp_path / "full.safetensors", norm_num_groups=4).state_dict(), ours.state_dict())
    save_file({"model.diffusion_model.img_in.weight": torch.zeros(2, 2)}, tmp_path / "dit.safetensors")
    with pytest.raises(ValueError, match="not an original-layout"):
        load_flux_ae_single_file(tmp_path / "dit.safetensors")
