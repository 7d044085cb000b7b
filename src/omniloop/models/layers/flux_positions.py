"""Timestep and RoPE tables, the RoPE rotation and the fp16 clip, shared by the FLUX.1 and FLUX.2
DiTs (the same diffusers numerics: ``Timesteps(flip_sin_to_cos=True, shift=0)``, ``FluxPosEmbed`` /
``Flux2PosEmbed``, ``apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`` and the blocks'
``clip(-65504, 65504)``), and the MLP that embeds a timestep's table (``MLPEmbedder``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPEmbedder", "apply_rope", "clip_fp16", "rope_tables", "timestep_embedding"]


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """``[S] -> [S, dim]`` fp32 ``[cos | sin]`` (diffusers ``Timesteps(flip_sin_to_cos=True, shift=0)``)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half
    args = t[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """``linear_2(silu(linear_1(x)))``: diffusers' ``TimestepEmbedding`` (FLUX.1 with biases, FLUX.2
    ``sample_proj_bias=False`` without) and ``PixArtAlphaTextProjection`` (FLUX.1's pooled text)."""

    def __init__(self, in_dim: int, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, in_dim] -> [S, dim]
        return self.linear_2(F.silu(self.linear_1(x)))


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


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x`` [..., L, H, hd] by ``rope`` = (cos, sin), each
    [L, hd] (``rope_tables``), in fp32, cast back. FLUX.1 passes packed tokens [N, H, hd], FLUX.2
    a batch [B, L, H, hd]: the tables broadcast as [L, 1, hd] over any leading batch axes."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]  # [L, 1, hd]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)  # each [..., L, H, hd/2]
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)  # [..., L, H, hd]: (-imag, real) pairs
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` clipped to fp16's finite range when it is fp16 (as diffusers' Flux blocks do after
    each residual update, so an overflow stays finite); other dtypes pass through unchanged."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x
