"""LTX-2's latent upsampler (diffusers ``LTX2LatentUpsamplerModel``), written natively: video
latents [B, C, f, h, w] (the VAE's space, not normalized) -> [B, C, f, 2h, 2w] (or 2f).

Conv + GroupNorm residual stacks around a pixel-shuffle upsampler (optionally a rational
resampler: shuffle by ``num`` then blur-downsample by ``den``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

RATIONAL_SCALES = {0.75: (3, 4), 1.5: (3, 2), 2.0: (2, 1), 4.0: (4, 1)}


@dataclass(frozen=True)
class LTX2UpsamplerConfig:
    in_channels: int = 128
    mid_channels: int = 1024
    num_blocks_per_stage: int = 4
    dims: int = 3
    spatial_upsample: bool = True
    temporal_upsample: bool = False
    rational_spatial_scale: float = 2.0
    use_rational_resampler: bool = True

    def __post_init__(self) -> None:
        if not (self.spatial_upsample or self.temporal_upsample):
            raise ValueError("latent upsampler config: spatial_upsample or temporal_upsample must be true")
        if self.spatial_upsample and not self.temporal_upsample and self.use_rational_resampler \
                and self.rational_spatial_scale not in RATIONAL_SCALES:
            raise ValueError(f"latent upsampler rational_spatial_scale={self.rational_spatial_scale}: pass one of "
                             f"{sorted(RATIONAL_SCALES)}")

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2UpsamplerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class ResBlock(nn.Module):
    def __init__(self, channels: int, dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.conv1, self.norm1 = conv(channels, channels, kernel_size=3, padding=1), nn.GroupNorm(32, channels)
        self.conv2, self.norm2 = conv(channels, channels, kernel_size=3, padding=1), nn.GroupNorm(32, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(h)) + x)


def pixel_shuffle(x: torch.Tensor, dims: int, factors: tuple[int, ...]) -> torch.Tensor:
    if dims == 3:
        return x.unflatten(1, (-1, *factors[:3])).permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)
    if dims == 2:
        return x.unflatten(1, (-1, *factors[:2])).permute(0, 1, 4, 2, 5, 3).flatten(4, 5).flatten(2, 3)
    return x.unflatten(1, (-1, *factors[:1])).permute(0, 1, 3, 2, 4, 5).flatten(2, 3)


class Shuffle(nn.Module):
    """A conv to ``factor`` x channels, then pixel shuffle (diffusers' Sequential(conv, shuffle))."""

    def __init__(self, conv: nn.Module, dims: int, factors: tuple[int, ...]) -> None:
        super().__init__()
        self.conv, self.dims, self.factors = conv, dims, factors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pixel_shuffle(self.conv(x), self.dims, self.factors)


class RationalResampler(nn.Module):
    kernel: torch.Tensor  # buffer: [1, 1, 5, 5] blur

    def __init__(self, channels: int, scale: float) -> None:
        super().__init__()
        self.num, self.den = RATIONAL_SCALES[scale]
        self.conv = nn.Conv2d(channels, self.num**2 * channels, kernel_size=3, padding=1)
        k = torch.tensor([math.comb(4, i) for i in range(5)])  # binomial blur, 5 taps
        k2d = k[:, None] @ k[None, :]
        self.register_buffer("kernel", (k2d / k2d.sum()).float()[None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(self.conv(x), 2, (self.num, self.num))
        if self.den == 1:
            return x
        c = x.shape[1]
        return F.conv2d(x, self.kernel.expand(c, 1, 5, 5), bias=None, stride=self.den, padding=2, groups=c)


class LTX2LatentUpsampler(nn.Module):
    def __init__(self, config: LTX2UpsamplerConfig) -> None:
        super().__init__()
        c = self.config = config
        conv = nn.Conv2d if c.dims == 2 else nn.Conv3d
        m = c.mid_channels
        self.initial_conv, self.initial_norm = conv(c.in_channels, m, kernel_size=3, padding=1), nn.GroupNorm(32, m)
        self.res_blocks = nn.ModuleList(ResBlock(m, c.dims) for _ in range(c.num_blocks_per_stage))
        if c.spatial_upsample and c.temporal_upsample:
            self.upsampler: nn.Module = Shuffle(nn.Conv3d(m, 8 * m, kernel_size=3, padding=1), 3, (2, 2, 2))
        elif c.spatial_upsample and c.use_rational_resampler:
            self.upsampler = RationalResampler(m, c.rational_spatial_scale)
        elif c.spatial_upsample:
            self.upsampler = Shuffle(nn.Conv2d(m, 4 * m, kernel_size=3, padding=1), 2, (2, 2))
        else:
            self.upsampler = Shuffle(nn.Conv3d(m, 2 * m, kernel_size=3, padding=1), 1, (2,))
        self.post_upsample_res_blocks = nn.ModuleList(ResBlock(m, c.dims) for _ in range(c.num_blocks_per_stage))
        self.final_conv = conv(m, c.in_channels, kernel_size=3, padding=1)

    @property
    def dtype(self) -> torch.dtype:
        return self.initial_conv.weight.dtype

    def _frames_2d(self, fn, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return fn(x.permute(0, 2, 1, 3, 4).flatten(0, 1)).unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = x.to(self.dtype)
        if c.dims == 2:
            def stack(h: torch.Tensor) -> torch.Tensor:
                h = F.silu(self.initial_norm(self.initial_conv(h)))
                for block in self.res_blocks:
                    h = block(h)
                h = self.upsampler(h)
                for block in self.post_upsample_res_blocks:
                    h = block(h)
                return self.final_conv(h)
            return self._frames_2d(stack, x)
        x = F.silu(self.initial_norm(self.initial_conv(x)))
        for block in self.res_blocks:
            x = block(x)
        if c.temporal_upsample:
            x = self.upsampler(x)[:, :, 1:, :, :]
        else:
            x = self._frames_2d(self.upsampler, x)
        for block in self.post_upsample_res_blocks:
            x = block(x)
        return self.final_conv(x)
