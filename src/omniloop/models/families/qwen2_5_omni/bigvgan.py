"""Token2wav's vocoder: BigVGAN, mel spectrogram -> waveform (transformers'
``Qwen2_5OmniToken2WavBigVGANModel``; module names are its, so the checkpoint loads as is).

Anti-aliased SnakeBeta activations (2x Kaiser-sinc up/down sampling around the activation),
AMP residual blocks, transposed-conv upsampling by ``prod(upsample_rates)`` samples per mel
frame. The input mel is the DiT's natural-log amplitude, mapped to [-1, 1] dB first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.snake import SnakeBeta

SAMPLE_RATE = 24000  # Qwen2.5-Omni's speech: 24 kHz mono


@dataclass(frozen=True, kw_only=True)
class BigVGANConfig:
    mel_dim: int
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "BigVGANConfig":
        out = cls(mel_dim=int(d["mel_dim"]), upsample_initial_channel=int(d["upsample_initial_channel"]),
                  resblock_kernel_sizes=tuple(int(k) for k in d["resblock_kernel_sizes"]),
                  resblock_dilation_sizes=tuple(tuple(int(x) for x in ds) for ds in d["resblock_dilation_sizes"]),
                  upsample_rates=tuple(int(r) for r in d["upsample_rates"]),
                  upsample_kernel_sizes=tuple(int(k) for k in d["upsample_kernel_sizes"]))
        if any(len(ds) != 3 for ds in out.resblock_dilation_sizes):
            raise ValueError(f"bigvgan_config.resblock_dilation_sizes {out.resblock_dilation_sizes}: each AMP block "
                             "has three dilated convolutions; pass three dilations per kernel size")
        return out

    @property
    def hop_length(self) -> int:
        return int(np.prod(self.upsample_rates))


def kaiser_sinc_filter1d(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """``[1, 1, kernel_size]`` Kaiser-windowed sinc low-pass filter (transformers' arithmetic)."""
    even = kernel_size % 2 == 0
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, dtype=torch.float32)
    t = torch.arange(-half, half) + 0.5 if even else torch.arange(kernel_size) - half
    if cutoff == 0:
        return torch.zeros((1, 1, kernel_size), dtype=torch.float32)
    f = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    f /= f.sum()
    return f.view(1, 1, kernel_size)


class UpSample1d(nn.Module):
    filter: torch.Tensor  # [1, 1, kernel] low-pass (a computed buffer, not in the checkpoint)

    def __init__(self, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        self.ratio, self.kernel_size, self.stride = ratio, kernel_size, ratio
        self.pad = kernel_size // ratio - 1
        self.pad_left = self.pad * self.stride + (kernel_size - self.stride) // 2
        self.pad_right = self.pad * self.stride + (kernel_size - self.stride + 1) // 2
        self.register_buffer("filter", kaiser_sinc_filter1d(0.5 / ratio, 0.6 / ratio, kernel_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(c, -1, -1), stride=self.stride, groups=c)
        return x[..., self.pad_left : -self.pad_right]


class DownSample1d(nn.Module):
    filter: torch.Tensor  # [1, 1, kernel] low-pass (a computed buffer, not in the checkpoint)

    def __init__(self, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        even = kernel_size % 2 == 0
        self.pad_left, self.pad_right, self.stride = kernel_size // 2 - int(even), kernel_size // 2, ratio
        self.register_buffer("filter", kaiser_sinc_filter1d(0.5 / ratio, 0.6 / ratio, kernel_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(c, -1, -1), stride=self.stride, groups=c)


class AntiAliasedActivation1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample, self.downsample = UpSample1d(), DownSample1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        pad = lambda d: int((kernel * d - d) / 2)  # noqa: E731
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, 1, dilation=d, padding=pad(d)) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, 1, dilation=1, padding=pad(1)) for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedActivation1d(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts1, acts2 = self.activations[::2], self.activations[1::2]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts1, acts2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class BigVGAN(nn.Module):
    """``mel [B, mel_dim, T]`` (natural-log amplitude) -> waveform ``[B, T * hop]`` in [-1, 1]."""

    def __init__(self, c: BigVGANConfig) -> None:
        super().__init__()
        self.config = c
        self.num_kernels = len(c.resblock_kernel_sizes)
        ch = c.upsample_initial_channel
        self.conv_pre = nn.Conv1d(c.mel_dim, ch, 7, 1, padding=3)
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2)])
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
        self.resblocks = nn.ModuleList(
            AMPBlock(ch // 2 ** (i + 1), k, d)
            for i in range(len(c.upsample_rates)) for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        last = ch // 2 ** len(c.upsample_rates)
        self.activation_post = AntiAliasedActivation1d(last)
        self.conv_post = nn.Conv1d(last, 1, 7, 1, padding=3, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    @staticmethod
    def normalized_db(mel: torch.Tensor) -> torch.Tensor:
        """Log-amplitude mel -> dB (floor -115 dB, -20 dB reference) scaled to [-1, 1]."""
        amplitude = torch.exp(mel)
        floor = torch.exp(torch.tensor(-115 / 20.0 * np.log(10), device=mel.device, dtype=mel.dtype))
        db = 20 * torch.log10(torch.clamp(amplitude, min=floor)) - 20
        return torch.clamp((2 * 1) * ((db - -115) / (--115)) - 1, -1, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(self.normalized_db(mel))
        for i, up in enumerate(self.ups):
            assert isinstance(up, nn.ModuleList)  # one ConvTranspose1d (the checkpoint's ``ups.i.0``)
            x = up[0](x)
            x = sum(self.resblocks[i * self.num_kernels + j](x) for j in range(self.num_kernels)) / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return torch.clamp(x, min=-1.0, max=1.0)[:, 0]  # [B, samples]
