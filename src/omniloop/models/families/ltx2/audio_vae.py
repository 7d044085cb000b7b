"""LTX-2's audio VAE decoder (diffusers ``AutoencoderKLLTX2Audio.decoder``), written natively:
audio latents [B, C, T, M] -> mel spectrogram [B, out_channels, 4T - 3, mel_bins] (causal).

A 2-D conv U-Net decoder over (time, mel) with causal padding along time, pixel- or
group-norm residual blocks and nearest-neighbour upsampling. Only the decoder is ported: the
LTX-2 pipelines never encode audio (the checkpoint's encoder weights are not loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

LATENT_DOWNSAMPLE_FACTOR = 4


@dataclass(frozen=True)
class LTX2AudioVAEConfig:
    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str | None = "height"
    dropout: float = 0.0
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    def __post_init__(self) -> None:
        if self.causality_axis not in ("none", "width", "height", "width-compatibility"):
            raise ValueError(f"audio VAE causality_axis={self.causality_axis!r} is not valid")
        if self.norm_type not in ("group", "pixel"):
            raise ValueError(f"audio VAE norm_type={self.norm_type!r}: pass 'pixel' or 'group'")

    @property
    def latent_mel_bins(self) -> int:
        """Mel bins of the latent (the encoder halves the mel axis twice)."""
        assert self.mel_bins is not None, "an LTX-2 audio VAE config names its mel_bins"
        return self.mel_bins // 4

    @property
    def temporal_ratio(self) -> int:
        """Mel frames per latent frame (diffusers' LTX2 pipelines: 4)."""
        return 4

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2AudioVAEConfig":
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}  # JSON values
        return cls(**kw)


class CausalConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, axis: str) -> None:
        super().__init__()
        ph = pw = kernel - 1
        if axis == "none":
            self.padding = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
        elif axis in ("width", "width-compatibility"):
            self.padding = (pw, 0, ph // 2, ph - ph // 2)
        else:  # height: causal along time
            self.padding = (pw // 2, pw - pw // 2, ph, 0)
        self.conv = nn.Conv2d(cin, cout, kernel, stride=1, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class PixelNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + 1e-6)


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True) if kind == "group" else PixelNorm()


def _conv(cin: int, cout: int, kernel: int, axis: str | None) -> nn.Module:
    if axis is not None:
        return CausalConv2d(cin, cout, kernel, axis)
    return nn.Conv2d(cin, cout, kernel, stride=1, padding=kernel // 2)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, c: LTX2AudioVAEConfig) -> None:
        super().__init__()
        self.norm1 = _norm(c.norm_type, cin)
        self.conv1 = _conv(cin, cout, 3, c.causality_axis)
        self.norm2 = _norm(c.norm_type, cout)
        self.conv2 = _conv(cout, cout, 3, c.causality_axis)
        self.nin_shortcut = _conv(cin, cout, 1, c.causality_axis) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int, norm_type: str) -> None:
        super().__init__()
        self.norm = _norm(norm_type, channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, w = q.shape
        q = q.reshape(b, c, hh * w).permute(0, 2, 1).contiguous()
        attn = torch.softmax(torch.bmm(q, k.reshape(b, c, hh * w).contiguous()) * (int(c) ** (-0.5)), dim=2)
        out = torch.bmm(v.reshape(b, c, hh * w), attn.permute(0, 2, 1).contiguous()).reshape(b, c, hh, w)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    def __init__(self, channels: int, axis: str | None) -> None:
        super().__init__()
        self.axis = axis
        self.conv = _conv(channels, channels, 3, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        if self.axis == "height":
            return x[:, :, 1:, :]
        if self.axis == "width":
            return x[:, :, :, 1:]
        return x


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()


class LTX2AudioDecoder(nn.Module):
    def __init__(self, config: LTX2AudioVAEConfig) -> None:
        super().__init__()
        c = self.config = config
        levels = len(c.ch_mult)
        channels = c.base_channels * c.ch_mult[-1]
        res = c.resolution // (2 ** (levels - 1))
        attn_res = set(c.attn_resolutions or ())
        self.conv_in = _conv(c.latent_channels, channels, 3, c.causality_axis)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(channels, channels, c)
        self.mid.attn_1 = AttnBlock(channels, c.norm_type) if c.mid_block_add_attention else nn.Identity()
        self.mid.block_2 = ResnetBlock(channels, channels, c)
        self.up = nn.ModuleList()
        for level in reversed(range(levels)):
            stage = Stage()
            out = c.base_channels * c.ch_mult[level]
            for _ in range(c.num_res_blocks + 1):
                stage.block.append(ResnetBlock(channels, out, c))
                channels = out
                if res in attn_res:
                    stage.attn.append(AttnBlock(channels, c.norm_type))
            if level != 0:
                stage.upsample = Upsample(channels, c.causality_axis)
                res *= 2
            self.up.insert(0, stage)
        self.norm_out = _norm(c.norm_type, channels)
        self.conv_out = _conv(channels, c.output_channels, 3, c.causality_axis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        c = self.config
        _, _, frames, mel = z.shape
        target_t = frames * LATENT_DOWNSAMPLE_FACTOR
        if c.causality_axis is not None:
            target_t = max(target_t - (LATENT_DOWNSAMPLE_FACTOR - 1), 1)
        target_f = c.mel_bins if c.mel_bins is not None else mel
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(range(len(c.ch_mult))):
            stage = self.up[level]
            for i, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if level != 0:
                h = stage.upsample(h)
        out = self.conv_out(F.silu(self.norm_out(h)))
        out = out[:, : c.output_channels, : min(out.shape[2], target_t), : min(out.shape[3], target_f)]
        pad_t, pad_f = target_t - out.shape[2], target_f - out.shape[3]
        if pad_t > 0 or pad_f > 0:
            out = F.pad(out, (0, max(pad_f, 0), 0, max(pad_t, 0)))
        return out[:, : c.output_channels, :target_t, :target_f]


class LTX2AudioVAE(nn.Module):
    """The decoder and the latent statistics (over packed channels x mel bins)."""

    def __init__(self, config: LTX2AudioVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = LTX2AudioDecoder(config)
        self.register_buffer("latents_mean", torch.zeros(config.base_channels))
        self.register_buffer("latents_std", torch.ones(config.base_channels))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    @torch.inference_mode()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z.to(self.dtype))
