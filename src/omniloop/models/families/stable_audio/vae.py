"""The Oobleck waveform autoencoder (Stable Audio's VAE), written natively.

Same math as diffusers' ``AutoencoderOobleck``: strided 1-D conv blocks of dilated residual
units with Snake activations. The checkpoint stores weight-normalized convs (``weight_g`` /
``weight_v``); ``weights.py`` folds each pair into one plain weight at load with
``torch._weight_norm`` (the function diffusers' forward calls each time), so inference runs
plain convs with the same weights.

Shapes: waveforms [B, audio_channels, S]; latents [B, decoder_input_channels, S / hop],
``hop = prod(downsampling_ratios)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.snake import ResidualUnit, Snake1d


@dataclass(frozen=True)
class OobleckConfig:
    encoder_hidden_size: int = 128
    downsampling_ratios: tuple[int, ...] = (2, 4, 4, 8, 8)
    channel_multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    decoder_channels: int = 128
    decoder_input_channels: int = 64
    audio_channels: int = 2
    sampling_rate: int = 44100
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def hop_length(self) -> int:
        return int(math.prod(self.downsampling_ratios))

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "OobleckConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}  # JSON values
        return cls(**kw)


def _residual_units(dim: int) -> nn.Sequential:
    return nn.Sequential(ResidualUnit(dim, 1), ResidualUnit(dim, 3), ResidualUnit(dim, 9))


class EncoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.units = _residual_units(in_dim)
        self.snake = Snake1d(in_dim)
        self.conv = nn.Conv1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.snake(self.units(x)))


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.snake = Snake1d(in_dim)
        self.conv_t = nn.ConvTranspose1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride,
                                         padding=math.ceil(stride / 2))
        self.units = _residual_units(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.units(self.conv_t(self.snake(x)))


class OobleckEncoder(nn.Module):
    def __init__(self, c: OobleckConfig) -> None:
        super().__init__()
        mult = (1, *c.channel_multiples)
        h = c.encoder_hidden_size
        self.conv_in = nn.Conv1d(c.audio_channels, h, kernel_size=7, padding=3)
        self.blocks = nn.Sequential(*(EncoderBlock(h * mult[i], h * mult[i + 1], s)
                                      for i, s in enumerate(c.downsampling_ratios)))
        self.snake = Snake1d(h * mult[-1])
        self.conv_out = nn.Conv1d(h * mult[-1], h, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.snake(self.blocks(self.conv_in(x))))


class OobleckDecoder(nn.Module):
    def __init__(self, c: OobleckConfig) -> None:
        super().__init__()
        mult = (1, *c.channel_multiples)
        ch, strides = c.decoder_channels, tuple(reversed(c.downsampling_ratios))
        n = len(strides)
        self.conv_in = nn.Conv1d(c.decoder_input_channels, ch * mult[-1], kernel_size=7, padding=3)
        self.blocks = nn.Sequential(*(DecoderBlock(ch * mult[n - i], ch * mult[n - i - 1], s)
                                      for i, s in enumerate(strides)))
        self.snake = Snake1d(ch)
        self.conv_out = nn.Conv1d(ch, c.audio_channels, kernel_size=7, padding=3, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.snake(self.blocks(self.conv_in(z))))


class OobleckVAE(nn.Module):
    def __init__(self, config: OobleckConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = OobleckEncoder(config)
        self.decoder = OobleckDecoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, audio_channels, S] -> (mean, std), each [B, latent, S / hop] (the posterior's
        std is softplus(scale) + 1e-4, as diffusers)."""
        mean, scale = self.encoder(waveform.to(self.dtype)).chunk(2, dim=1)
        return mean, F.softplus(scale) + 1e-4

    @torch.inference_mode()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """[B, latent, L] -> waveform [B, audio_channels, L * hop] (not clamped, as diffusers)."""
        return self.decoder(z.to(self.dtype))
