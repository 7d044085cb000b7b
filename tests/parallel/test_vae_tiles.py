"""Parallel VAE decode: the tiles of a tiled decode spread over 2 gloo ranks give the video a
single process decodes from the same tiles, bit for bit (each tile is decoded by one rank
and broadcast; every rank blends the same tiles in the same order)."""

from __future__ import annotations

import torch

from tests.factories import tiny_wan_vae_config
from tests.parallel.ranks import rank_threads, run_ranks, threads

TILE, STRIDE = 16, 8  # pixels (2 and 1 latents): 4 x 6 latents are 24 overlapping tiles


def _vae_and_latents():
    from omniloop.models.autoencoders.wan_vae import WanVAE, WanVAEConfig, WanVAETiling

    torch.manual_seed(0)
    vae = WanVAE(WanVAEConfig(**tiny_wan_vae_config())).eval()
    z = torch.randn(1, 4, 2, 4, 6, generator=torch.Generator().manual_seed(2))
    return vae, z, WanVAETiling(tile_height=TILE, tile_width=TILE, stride_height=STRIDE, stride_width=STRIDE)


def _decode_on_ranks(rank, world):
    from omniloop.parallel.vae import TiledParallelVAE

    vae, z, tiling = _vae_and_latents()
    decoded = []
    wrapped = TiledParallelVAE(vae, tiling)
    real = wrapped.map_tiles

    def counting(decode, tiles):
        out = real(lambda t: (decoded.append(1), decode(t))[1], tiles)
        return out

    wrapped.map_tiles = counting
    with torch.inference_mode():
        video = wrapped.decode(z)
    return video, len(decoded), wrapped.config.z_dim


def test_tiles_across_two_ranks_equal_one_process():
    vae, z, tiling = _vae_and_latents()
    with torch.inference_mode(), threads(rank_threads(2)):
        expected = vae.decode(z, tiling)
        untiled = vae.decode(z)
    results = run_ranks(_decode_on_ranks, 2)
    for video, decoded, z_dim in results:
        assert torch.equal(video, expected)
        assert z_dim == 4  # everything but decode is the wrapped VAE's
    assert [n for _, n, _ in results] == [12, 12], "each rank decoded its half of the 24 tiles"
    assert not torch.equal(expected, untiled)  # tiling changes the seams (as diffusers' tiled decode)
