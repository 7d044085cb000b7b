"""Parallel VAE decode: the spatial tiles of a tiled decode spread across the pool's ranks.

Tile ``t`` is decoded by rank ``t mod world``, then broadcast from it; every rank blends
the same decoded tiles in the same order, so the video is bit-identical to one process
decoding the same tiles (the seams differ from an untiled decode exactly as diffusers'
tiled decode does). xDiT's DistVAE is the same idea at patch granularity.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TileMap:
    """``map_tiles(decode, tiles)`` for the VAE's tiled decode, over ``group`` (None: world)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))

    def __call__(self, decode: Callable[[torch.Tensor], torch.Tensor], tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [decode(t) if i % self.world == self.rank else None for i, t in enumerate(tiles)]
        for i, tile in enumerate(tiles):
            owner = i % self.world
            # shape and dtype first (int64 [6]), then the tile: non-owners cannot know the dtype
            head = torch.zeros(6, dtype=torch.int64, device=tile.device)
            if owner == self.rank:
                decoded = out[i]
                assert decoded is not None and decoded.dim() == 5
                head[:5] = torch.tensor(decoded.shape)
                head[5] = _DTYPES.index(decoded.dtype)
            dist.broadcast(head, src=self.ranks[owner], group=self.group)
            if owner != self.rank:
                out[i] = torch.empty(tuple(head[:5].tolist()), dtype=_DTYPES[int(head[5])], device=tile.device)
            tile_out = out[i]
            assert tile_out is not None, f"tile {i}: decoded here or allocated for its owner's broadcast"
            dist.broadcast(tile_out.contiguous() if owner == self.rank else tile_out, src=self.ranks[owner],
                           group=self.group)
        return [t for t in out if t is not None]


class TiledParallelVAE:
    """A VAE component whose ``decode`` is a tiled decode with the tiles spread across ranks;
    everything else (encode, latent normalization, dtype, config) is the wrapped VAE's."""

    streams_frames = False  # its decode is tiled: a frame-by-frame stream of the whole frame would differ

    def __init__(self, vae: Any, tiling: Any, group: Any = None) -> None:
        self._vae = vae
        self.tiling = tiling
        self.map_tiles = TileMap(group)

    def decode(self, z: torch.Tensor, tiling: Any = None, *, whole: bool | None = False) -> torch.Tensor:
        return self._vae.decode(z, tiling or self.tiling, whole=whole, map_tiles=self.map_tiles)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)
