"""The Wan2.2 VAE (``is_residual=True``, ``patch_size=2``, z_dim 48: Wan2.2 TI2V-5B and
Cosmos3) == diffusers' ``AutoencoderKLWan`` with that config, on a tiny random checkpoint
saved by diffusers (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.autoencoders.wan_vae import WanVAEConfig, load_wan_vae

diffusers = pytest.importorskip("diffusers")

# Wan2.2's config at toy width: residual blocks, 2x2 patchify, 48 latent channels, 16x spatial
WAN22_TINY = dict(
    base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[0.01 * i for i in range(48)], latents_std=[1.0 + 0.02 * i for i in range(48)],
)
ATOL = 1e-5  # measured 5e-7 (encode) / 1.3e-6 (decode): the RMS norm computes the norm another way


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan22_vae")
    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(**WAN22_TINY).save_pretrained(folder)
    ref = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
    return ref, load_wan_vae(folder, dtype=torch.float32)


def test_config_reads_the_wan22_layout():
    config = WanVAEConfig.from_diffusers_config({**WAN22_TINY, "_class_name": "AutoencoderKLWan"})
    assert config.is_residual and config.patch_size == 2
    assert config.scale_factor_spatial == 16 and config.scale_factor_temporal == 4
    with pytest.raises(ValueError, match="scale_factor_spatial=8 but its architecture gives 16"):
        WanVAEConfig.from_diffusers_config({**WAN22_TINY, "scale_factor_spatial": 8})


@pytest.mark.parametrize("frames, height, width", [(1, 32, 32), (5, 32, 64)])
@torch.no_grad()
def test_encode_decode_match_diffusers(vaes, frames, height, width):
    ref, ours = vaes
    x = torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    want = ref.encode(x).latent_dist.mode()
    mean, _ = ours.encode(x)
    assert mean.shape == (1, 48, 1 + (frames - 1) // 4, height // 16, width // 16)
    torch.testing.assert_close(mean, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(ours.encode(x, whole=True)[0], want, rtol=0, atol=ATOL)
    video = ref.decode(want).sample
    torch.testing.assert_close(ours.decode(want), video, rtol=0, atol=ATOL)
    torch.testing.assert_close(ours.decode(want, whole=True), video, rtol=0, atol=ATOL)


@torch.no_grad()
def test_tiled_decode_matches_diffusers(vaes):
    """Tiles blended in the patchified grid, then unpatchified: diffusers' ``tiled_decode``
    with ``patch_size`` (96x96 pixels in 64-pixel tiles at a 32-pixel stride: 3 x 3 tiles)."""
    from omniloop.models.autoencoders.wan_vae import WanVAETiling

    ref, ours = vaes
    z = torch.randn(1, 48, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    ref.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    try:
        want = ref.decode(z).sample
    finally:
        ref.disable_tiling()
    tiling = WanVAETiling(tile_height=64, tile_width=64, stride_height=32, stride_width=32)
    got = ours.decode(z, tiling)
    assert got.shape == want.shape == (1, 3, 5, 96, 96)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (got - ours.decode(z)).abs().max() > 1e-4  # the tiles really were blended
