"""Diffusion timestep features shared by the DiT families.

``sinusoidal_timestep_embedding`` is diffusers' ``Timesteps(num_channels, flip_sin_to_cos=True,
downscale_freq_shift=0)``; ``TwoLayerMLP`` its ``TimestepEmbedding`` (``linear_1 -> act ->
linear_2``, the key names diffusers checkpoints use).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal_timestep_embedding(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """``[N] -> [N, dim]`` fp32 ``[cos | sin]`` features (diffusers ``Timesteps(flip_sin_to_cos=True, shift=0)``)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(0, half, dtype=torch.float32, device=timestep.device) / half
    args = timestep[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TwoLayerMLP(nn.Module):
    """``linear_2(act(linear_1(x)))``; the time and text embedders (key names as diffusers')."""

    def __init__(self, in_dim: int, dim: int, act: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = act
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
