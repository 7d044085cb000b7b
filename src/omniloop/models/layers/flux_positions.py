"""Timestep and RoPE tables shared by the FLUX.1 and FLUX.2 DiTs (the same diffusers numerics:
``Timesteps(flip_sin_to_cos=True, shift=0)`` and ``FluxPosEmbed`` / ``Flux2PosEmbed``)."""

from __future__ import annotations

import math

import torch

__all__ = ["rope_tables", "timestep_embedding"]


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """``[S] -> [S, dim]`` fp32 ``[cos | sin]`` (diffusers ``Timesteps(flip_sin_to_cos=True, shift=0)``)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half
    args = t[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [N, n_axes] -> (cos, sin), each [N, hd] fp32, each axis's angles computed
    in fp64 and each value repeated for its channel pair (diffusers ``FluxPosEmbed``)."""
    pos = ids.float()
    freqs_dtype = torch.float32 if ids.device.type == "mps" else torch.float64
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=ids.device) / dim))
        angles = torch.outer(pos[:, i], inv)  # [N, dim/2] fp64
        cos.append(angles.cos().repeat_interleave(2, dim=1, output_size=dim).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1, output_size=dim).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)
