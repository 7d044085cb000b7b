"""The toy family's own VAE decoder: latents [B, C, F, h, w] -> pixels [B, 3, F, 4h, 4w] in
[-1, 1], each frame decoded alone (no temporal compression). It offers what the shared
``VAEDecode`` stage calls of a video VAE: ``denormalize_latents``, ``decode`` and ``dtype``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ToyVAEConfig:
    latent_channels: int = 4
    hidden: int = 16
    latents_mean: float = 0.0
    latents_std: float = 1.0


SCALE_SPATIAL = 4  # pixels per latent, each side (two 2x upsampling stages)
SCALE_TEMPORAL = 1  # frames per latent frame


class ToyVAE(nn.Module):
    def __init__(self, config: ToyVAEConfig) -> None:
        super().__init__()
        self.config = config
        c, hid = config.latent_channels, config.hidden
        self.conv_in = nn.Conv2d(c, hid, 3, padding=1)
        self.up = nn.ModuleList(nn.Conv2d(hid, hid, 3, padding=1) for _ in range(2))
        self.conv_out = nn.Conv2d(hid, 3, 3, padding=1)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_in.weight.dtype

    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """The DiT's normalized latents -> the decoder's."""
        return z * self.config.latents_std + self.config.latents_mean

    @torch.inference_mode()
    def decode(self, z: torch.Tensor, whole: bool | None = None) -> torch.Tensor:
        """[B, C, F, h, w] -> [B, 3, F, 4h, 4w] in [-1, 1] (``whole``: frames are decoded
        alone anyway, so every value gives the same pixels)."""
        b, c, f, h, w = z.shape
        x = z.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)  # frames into the batch
        x = torch.nn.functional.silu(self.conv_in(x))
        for conv in self.up:
            x = torch.nn.functional.silu(conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")))
        x = torch.tanh(self.conv_out(x))  # [B * F, 3, 4h, 4w]
        return x.reshape(b, f, 3, SCALE_SPATIAL * h, SCALE_SPATIAL * w).permute(0, 2, 1, 3, 4)
