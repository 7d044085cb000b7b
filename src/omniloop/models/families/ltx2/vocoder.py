"""LTX-2's vocoder (diffusers ``LTX2Vocoder``, HiFi-GAN / BigVGAN style), written natively:
mel spectrogram [B, channels, T, mel] -> waveform [B, out_channels, T * prod(upsample_factors)].

Transposed-conv upsampling stages, each followed by the mean of parallel dilated residual
stacks; LeakyReLU (LTX-2.0) or anti-aliased SnakeBeta activations. (LTX-2.3's vocoder with
bandwidth extension, ``LTX2VocoderWithBWE``, runs two of these: ``vocoder_bwe.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LTX2VocoderConfig:
    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
    upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000

    def __post_init__(self) -> None:
        if len(self.upsample_kernel_sizes) != len(self.upsample_factors):
            raise ValueError("vocoder config: upsample_kernel_sizes and upsample_factors differ in length")
        if len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
            raise ValueError("vocoder config: resnet_kernel_sizes and resnet_dilations differ in length")
        if self.act_fn not in ("snakebeta", "snake", "leaky_relu"):
            raise ValueError(f"vocoder act_fn={self.act_fn!r}: pass 'leaky_relu', 'snake' or 'snakebeta'")
        if self.act_fn == "leaky_relu" and self.antialias:
            raise ValueError("vocoder: antialias with leaky_relu is not supported (no LTX-2 checkpoint uses it)")

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2VocoderConfig":
        known = {f.name for f in fields(cls)}
        def tuples(v: Any) -> Any:  # JSON lists (nested too) -> tuples
            return tuple(tuples(x) for x in v) if isinstance(v, list) else v

        return cls(**{k: tuples(v) for k, v in d.items() if k in known})


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """A Kaiser-windowed sinc low-pass filter [kernel_size] (BigVGAN's, diffusers' arithmetic)."""
    delta_f = 4 * half_width
    half = kernel_size // 2
    amplitude = 2.285 * (half - 1) * math.pi * delta_f + 7.95
    if amplitude > 50.0:
        beta = 0.1102 * (amplitude - 8.7)
    elif amplitude >= 21.0:
        beta = 0.5842 * (amplitude - 21) ** 0.4 + 0.07886 * (amplitude - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False)
    time = torch.arange(-half, half) + 0.5 if kernel_size % 2 == 0 else torch.arange(kernel_size) - half
    if cutoff == 0.0:
        return torch.zeros_like(time)
    time = 2 * cutoff * time
    sinc = torch.where(time == 0, torch.ones_like(time), torch.sin(math.pi * time) / math.pi / time)
    filt = 2 * cutoff * window * sinc
    return filt / filt.sum()


class SnakeBeta(nn.Module):
    def __init__(self, channels: int, use_beta: bool = True) -> None:
        super().__init__()
        self.use_beta = use_beta
        self.alpha = nn.Parameter(torch.zeros(channels))
        if use_beta:
            self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha.view(1, -1, 1))
        amplitude = torch.exp(self.beta.view(1, -1, 1)) if self.use_beta else alpha
        return x + (1.0 / (amplitude + 1e-9)) * torch.sin(x * alpha).pow(2)


class AntiAliased(nn.Module):
    """Upsample 2x (Kaiser sinc), activate, low-pass and downsample back."""

    up_filter: torch.Tensor  # buffers: [1, 1, kernel_size]
    down_filter: torch.Tensor

    def __init__(self, act: nn.Module, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio, self.kernel_size, self.act = ratio, kernel_size, act
        self.up_pad = kernel_size // ratio - 1
        self.up_left = self.up_pad * ratio + (kernel_size - ratio) // 2
        self.up_right = self.up_pad * ratio + (kernel_size - ratio + 1) // 2
        self.down_left, self.down_right = kernel_size // 2 + kernel_size % 2 - 1, kernel_size // 2
        self.register_buffer("up_filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size).view(1, 1, -1))
        self.register_buffer("down_filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size).view(1, 1, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        y = F.pad(x, (self.up_pad, self.up_pad), mode="replicate")
        y = self.ratio * F.conv_transpose1d(y, self.up_filter.to(dtype=y.dtype).expand(c, -1, -1), stride=self.ratio,
                                            groups=c)
        y = self.act(y[..., self.up_left:-self.up_right])
        y = F.pad(y, (self.down_left, self.down_right), mode="replicate")
        return F.conv1d(y, self.down_filter.expand(c, -1, -1), stride=self.ratio, groups=c)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], c: LTX2VocoderConfig) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding="same")
                                    for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=1, padding="same")
                                    for _ in dilations)
        self.acts1 = nn.ModuleList(self._act(channels, c) for _ in dilations)
        self.acts2 = nn.ModuleList(self._act(channels, c) for _ in dilations)

    @staticmethod
    def _act(channels: int, c: LTX2VocoderConfig) -> nn.Module:
        if c.act_fn == "leaky_relu":
            return nn.LeakyReLU(negative_slope=c.leaky_relu_negative_slope)
        act = SnakeBeta(channels, use_beta=c.act_fn == "snakebeta")
        return AntiAliased(act, c.antialias_ratio, c.antialias_kernel_size) if c.antialias else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.acts1, self.convs1, self.acts2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class LTX2Vocoder(nn.Module):
    def __init__(self, config: LTX2VocoderConfig) -> None:
        super().__init__()
        c = self.config = config
        self.conv_in = nn.Conv1d(c.in_channels, c.hidden_channels, kernel_size=7, stride=1, padding=3)
        self.upsamplers, self.resnets = nn.ModuleList(), nn.ModuleList()
        channels = c.hidden_channels
        for stride, kernel in zip(c.upsample_factors, c.upsample_kernel_sizes):
            out = channels // 2
            self.upsamplers.append(nn.ConvTranspose1d(channels, out, kernel, stride=stride, padding=(kernel - stride) // 2))
            for k, dilations in zip(c.resnet_kernel_sizes, c.resnet_dilations):
                self.resnets.append(ResBlock(out, k, dilations, c))
            channels = out
        if c.act_fn in ("snakebeta", "snake"):
            self.act_out: nn.Module = AntiAliased(SnakeBeta(channels, use_beta=True), c.antialias_ratio,
                                                  c.antialias_kernel_size)
        else:
            self.act_out = nn.LeakyReLU()  # NOTE: the default slope, as the original code
        self.conv_out = nn.Conv1d(channels, c.out_channels, 7, stride=1, padding=3, bias=c.final_bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_in.weight.dtype

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, C, T, mel] -> [B, out_channels, T * prod(upsample_factors)]."""
        c = self.config
        x = self.conv_in(mel.transpose(2, 3).flatten(1, 2))
        per_stage = len(c.resnet_kernel_sizes)
        for i, up in enumerate(self.upsamplers):
            if c.act_fn == "leaky_relu":
                x = F.leaky_relu(x, negative_slope=c.leaky_relu_negative_slope)
            x = up(x)
            x = torch.mean(torch.stack([self.resnets[j](x) for j in range(i * per_stage, (i + 1) * per_stage)]), dim=0)
        x = self.conv_out(self.act_out(x))
        if c.final_act_fn == "tanh":
            return torch.tanh(x)
        if c.final_act_fn == "clamp":
            return torch.clamp(x, -1, 1)
        return x
