"""LTX-2.3's vocoder with bandwidth extension (diffusers ``LTX2VocoderWithBWE``), written natively:
mel [B, C, T, mel] -> a 16 kHz waveform (the first vocoder) -> its causal log-mel -> a second
vocoder (``bwe_generator``) predicts the high band as a residual over the waveform upsampled by
a Hann-windowed sinc -> clamped to [-1, 1] at 48 kHz.

The STFT bases and the mel filterbank are checkpoint buffers (trained with them in bf16), not
recomputed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderConfig

_VOCODER = ("in_channels", "hidden_channels", "out_channels", "upsample_kernel_sizes", "upsample_factors",
            "resnet_kernel_sizes", "resnet_dilations", "act_fn", "leaky_relu_negative_slope", "antialias",
            "antialias_ratio", "antialias_kernel_size", "final_act_fn", "final_bias")


@dataclass(frozen=True)
class LTX2VocoderBWEConfig:
    vocoder: LTX2VocoderConfig  # 16 kHz
    bwe: LTX2VocoderConfig  # the high band at output_sampling_rate
    filter_length: int = 512
    hop_length: int = 80
    window_length: int = 512
    num_mel_channels: int = 64
    input_sampling_rate: int = 16000
    output_sampling_rate: int = 48000

    def __post_init__(self) -> None:
        if self.output_sampling_rate % self.input_sampling_rate:
            raise ValueError(f"vocoder: output_sampling_rate {self.output_sampling_rate} is not a multiple of "
                             f"input_sampling_rate {self.input_sampling_rate}")

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2VocoderBWEConfig":
        """diffusers' flat config (``bwe_``-prefixed fields for the second vocoder); the
        diffusers class defaults fill what it leaves out, as ``LTX2VocoderWithBWE`` does."""
        defaults = dict(in_channels=128, hidden_channels=1536, out_channels=2, upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
                        upsample_factors=[5, 2, 2, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11],
                        resnet_dilations=[[1, 3, 5]] * 3, act_fn="snakebeta", leaky_relu_negative_slope=0.1,
                        antialias=True, antialias_ratio=2, antialias_kernel_size=12, final_act_fn=None,
                        final_bias=False)
        bwe_defaults = dict(defaults, hidden_channels=512, upsample_kernel_sizes=[12, 11, 4, 4, 4],
                            upsample_factors=[6, 5, 2, 2, 2])
        top = {f.name: d[f.name] for f in fields(cls) if f.name not in ("vocoder", "bwe") and f.name in d}
        first = {k: d.get(k, defaults[k]) for k in _VOCODER}
        second = {k: d.get(f"bwe_{k}", bwe_defaults[k]) for k in _VOCODER}
        rate_in, rate_out = top.get("input_sampling_rate", 16000), top.get("output_sampling_rate", 48000)
        return cls(vocoder=LTX2VocoderConfig.from_diffusers_config({**first, "output_sampling_rate": rate_in}),
                   bwe=LTX2VocoderConfig.from_diffusers_config({**second, "output_sampling_rate": rate_out}), **top)


def hann_sinc_filter(ratio: int, rolloff: float = 0.99, zero_crossings: int = 6) -> tuple[torch.Tensor, int]:
    """The resampler's low-pass [2 * width * ratio + 1] (a Hann-windowed sinc) and its width."""
    width = math.ceil(zero_crossings / rolloff)
    size = 2 * width * ratio + 1
    t = (torch.arange(size) / ratio - width) * rolloff
    window = torch.cos(t.clamp(-zero_crossings, zero_crossings) * math.pi / zero_crossings / 2) ** 2
    return torch.sinc(t) * window * rolloff / ratio, width


class CausalSTFT(nn.Module):
    forward_basis: torch.Tensor

    def __init__(self, filter_length: int, hop_length: int, window_length: int) -> None:
        super().__init__()
        self.hop_length, self.window_length = hop_length, window_length
        freqs = filter_length // 2 + 1
        self.register_buffer("forward_basis", torch.zeros(freqs * 2, 1, filter_length))  # checkpoint: DFT x Hann
        self.register_buffer("inverse_basis", torch.zeros(freqs * 2, 1, filter_length))  # unused, loaded

    def magnitude(self, wave: torch.Tensor) -> torch.Tensor:
        """[N, samples] -> [N, freqs, frames]; causal: padded on the left only."""
        spec = F.conv1d(F.pad(wave.unsqueeze(1), (max(0, self.window_length - self.hop_length), 0)),
                        self.forward_basis, stride=self.hop_length)
        real, imag = spec.chunk(2, dim=1)
        return torch.sqrt(real**2 + imag**2)


class MelSTFT(nn.Module):
    mel_basis: torch.Tensor

    def __init__(self, filter_length: int, hop_length: int, window_length: int, mels: int) -> None:
        super().__init__()
        self.stft_fn = CausalSTFT(filter_length, hop_length, window_length)
        self.register_buffer("mel_basis", torch.zeros(mels, filter_length // 2 + 1))  # checkpoint

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """[N, samples] -> log-mel [N, mels, frames]."""
        magnitude = self.stft_fn.magnitude(wave)
        return torch.log(torch.clamp(self.mel_basis.to(magnitude.dtype) @ magnitude, min=1e-5))


class LTX2VocoderWithBWE(nn.Module):
    def __init__(self, config: LTX2VocoderBWEConfig) -> None:
        super().__init__()
        c = self.config = config
        self.vocoder = LTX2Vocoder(c.vocoder)
        self.bwe_generator = LTX2Vocoder(c.bwe)
        self.mel_stft = MelSTFT(c.filter_length, c.hop_length, c.window_length, c.num_mel_channels)
        self.ratio = c.output_sampling_rate // c.input_sampling_rate

    @property
    def dtype(self) -> torch.dtype:
        return self.vocoder.dtype

    def upsample(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, n] -> [B, C, n * ratio] (replicate-padded sinc interpolation). The filter is
        made here, not a buffer: the checkpoint does not hold it and modules load from meta."""
        kernel, pad = hann_sinc_filter(self.ratio)
        channels, size = x.shape[1], kernel.numel()
        y = F.pad(x, (pad, pad), mode="replicate")
        y = self.ratio * F.conv_transpose1d(y, kernel.to(x.device, y.dtype).view(1, 1, -1).expand(channels, -1, -1),
                                            stride=self.ratio, groups=channels)
        return y[..., 2 * pad * self.ratio: -(size - self.ratio)]

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, C, T, mel] -> [B, out_channels, samples at output_sampling_rate]."""
        c = self.config
        x = self.vocoder(mel)  # [B, C, n] at input_sampling_rate
        b, channels, n = x.shape
        if n % c.hop_length:  # whole mel frames
            x = F.pad(x, (0, c.hop_length - n % c.hop_length))
        high_mel = self.mel_stft(x.flatten(0, 1)).unflatten(0, (b, channels))  # [B, C, mels, frames]
        residual = self.bwe_generator(high_mel.transpose(2, 3))
        wave = torch.clamp(residual + self.upsample(x), -1, 1)
        return wave[..., : n * c.output_sampling_rate // c.input_sampling_rate]
