"""The 2D KL autoencoder (diffusers ``AutoencoderKL``: Flux.1, SD3, SD/SDXL), written natively.

Image ``[B, 3, H, W]`` in ``[-1, 1]`` <-> latents ``[B, latent_channels, H/8, W/8]`` (for
four levels: ``2 ** (levels - 1)`` downsampling). Module names are diffusers', so a
``vae/`` folder's state dict loads without renames; the deprecated attention names
(``query``/``key``/``value``/``proj_attn``) of old checkpoints are mapped as diffusers does.

Same math as diffusers (tests/models/flux/test_vae_parity.py, bit for bit in fp32 on CPU):
ResNet blocks of GroupNorm -> SiLU -> 3x3 conv, one single-head self-attention in each
mid block, a strided conv after right/bottom zero padding to downsample, nearest x2 +
conv to upsample. The module holds only weights (no tiling or slicing state).

Latent normalization (the DiT's space): ``(z - shift_factor) * scaling_factor`` (Flux:
0.1159, 0.3611; ``shift_factor`` None means 0).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniloop.models.checkpoint_files import load_diffusers_model
from omniloop.models.diffusers_config import config_from_diffusers

_EPS = 1e-6


@dataclass(kw_only=True)
class KL2DConfig:
    """``AutoencoderKL`` config keys (the ones that shape the network and its latents)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | list[int] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self) -> None:
        self.block_out_channels = tuple(self.block_out_channels)
        self.down_block_types = tuple(self.down_block_types)
        self.up_block_types = tuple(self.up_block_types)
        levels = len(self.block_out_channels)
        if any(t != "DownEncoderBlock2D" for t in self.down_block_types) or len(self.down_block_types) != levels:
            raise ValueError(f"down_block_types must be {levels} x 'DownEncoderBlock2D', got {list(self.down_block_types)}")
        if any(t != "UpDecoderBlock2D" for t in self.up_block_types) or len(self.up_block_types) != levels:
            raise ValueError(f"up_block_types must be {levels} x 'UpDecoderBlock2D', got {list(self.up_block_types)}")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn={self.act_fn!r} is not supported; AutoencoderKL checkpoints use 'silu'")
        if self.latents_mean is not None or self.latents_std is not None:
            raise ValueError("latents_mean/latents_std normalization (SDXL-style per-channel stats) is not supported; "
                             "this VAE normalizes with scaling_factor and shift_factor")
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                raise ValueError(f"block_out_channels {list(self.block_out_channels)} must be multiples of "
                                 f"norm_num_groups={self.norm_num_groups}")

    @property
    def scale_factor_spatial(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "KL2DConfig":
        return config_from_diffusers(cls, d, "AutoencoderKL")


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv3x3, twice, plus a 1x1 shortcut when the width changes."""

    def __init__(self, in_ch: int, out_ch: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=_EPS)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=_EPS)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class SpatialSelfAttention(nn.Module):
    """One head over all ``H*W`` positions, with a GroupNorm in front and a residual."""

    def __init__(self, ch: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, ch, eps=_EPS)
        self.to_q = nn.Linear(ch, ch)
        self.to_k = nn.Linear(ch, ch)
        self.to_v = nn.Linear(ch, ch)
        self.to_out = nn.ModuleList([nn.Linear(ch, ch)])  # ``to_out.0`` (diffusers' [Linear, Dropout])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x.view(b, c, h * w)).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(t)[:, None] for proj in (self.to_q, self.to_k, self.to_v))  # [B, 1, HW, C]
        out = F.scaled_dot_product_attention(q, k, v)[:, 0].to(q.dtype)  # [B, HW, C]
        out = self.to_out[0](out)
        return out.transpose(-1, -2).reshape(b, c, h, w) + x


class MidBlock(nn.Module):
    def __init__(self, ch: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(ch, ch, groups), ResnetBlock(ch, ch, groups)])
        self.attentions = nn.ModuleList([SpatialSelfAttention(ch, groups)]) if attention else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Downsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric: right and bottom (diffusers, padding=0)


class Upsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class DownBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups) for i in range(layers)])
        self.downsamplers = nn.ModuleList([Downsample(out_ch)]) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class UpBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups) for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample(out_ch)]) if upsample else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Encoder(nn.Module):
    def __init__(self, cfg: KL2DConfig) -> None:
        super().__init__()
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([
            DownBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, g, downsample=i < len(ch) - 1)
            for i in range(len(ch))
        ])
        self.mid_block = MidBlock(ch[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1)  # mean ++ logvar

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: KL2DConfig) -> None:
        super().__init__()
        ch, g = tuple(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.mid_block = MidBlock(ch[0], g, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList([
            UpBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, g, upsample=i < len(ch) - 1)
            for i in range(len(ch))
        ])
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(ch[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


@dataclass(frozen=True)
class LatentMoments:
    """The encoder's diagonal Gaussian over latents (diffusers' DiagonalGaussianDistribution)."""

    mean: Tensor  # [B, C, h, w]
    logvar: Tensor  # [B, C, h, w], clamped to [-30, 20]

    @property
    def std(self) -> Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, noise: Tensor) -> Tensor:
        """``mean + std * noise`` (the caller draws ``noise``, so the RNG stays per request)."""
        return self.mean + self.std * noise


class KL2DAutoencoder(nn.Module):
    """Holds only weights: one module serves concurrent requests."""

    def __init__(self, config: KL2DConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        c = config.latent_channels
        self.quant_conv = nn.Conv2d(2 * c, 2 * c, 1) if config.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(c, c, 1) if config.use_post_quant_conv else None

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    def encode(self, image: Tensor) -> LatentMoments:
        """[B, 3, H, W] in [-1, 1] -> the latent moments, each [B, C, H/s, W/s]."""
        s = self.config.scale_factor_spatial
        if image.dim() != 4 or image.shape[1] != self.config.in_channels or image.shape[2] % s or image.shape[3] % s:
            raise ValueError(f"encode takes images [B, {self.config.in_channels}, H, W] with H, W divisible by {s}; "
                             f"got shape {tuple(image.shape)}")
        h = self.encoder(image.to(self.dtype))
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        mean, logvar = h.chunk(2, dim=1)
        return LatentMoments(mean, logvar.clamp(-30.0, 20.0))

    def decode(self, z: Tensor) -> Tensor:
        """Latents [B, C, h, w] (VAE space) -> images [B, 3, s h, s w], about [-1, 1] (unclamped)."""
        z = z.to(self.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def normalize_latents(self, z: Tensor) -> Tensor:
        """VAE latents -> the DiT's latent space."""
        return (z - (self.config.shift_factor or 0.0)) * self.config.scaling_factor

    def denormalize_latents(self, z: Tensor) -> Tensor:
        """The DiT's latent space -> VAE latents (what ``decode`` takes)."""
        return z / self.config.scaling_factor + (self.config.shift_factor or 0.0)


# Deprecated attention-block names (pre-0.14 checkpoints) -> today's (diffusers converts them
# the same way when it loads a ``_from_deprecated_attn_block`` attention).
_OLD_ATTENTION = ((re.compile(r"\.attentions\.(\d+)\.query\."), r".attentions.\1.to_q."),
                  (re.compile(r"\.attentions\.(\d+)\.key\."), r".attentions.\1.to_k."),
                  (re.compile(r"\.attentions\.(\d+)\.value\."), r".attentions.\1.to_v."),
                  (re.compile(r"\.attentions\.(\d+)\.proj_attn\."), r".attentions.\1.to_out.0."))


def _renamed(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in _OLD_ATTENTION:
            key = pattern.sub(repl, key)
        if re.search(r"\.attentions\.\d+\.to_[qkv]\.weight$|\.to_out\.0\.weight$", key) and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0]  # 1x1 conv weights of the oldest layout
        out[key] = tensor
    return out


def load_kl2d_vae(folder: Path | str, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> KL2DAutoencoder:
    """Build from a diffusers ``vae/`` folder (``AutoencoderKL``), in eval mode, without grads."""
    return load_diffusers_model(folder, lambda config: KL2DAutoencoder(KL2DConfig.from_diffusers_config(config)),
                                class_name="AutoencoderKL", what="AutoencoderKL", subfolder="vae",
                                checkpoint="the checkpoint", device=device, dtype=dtype, convert=_renamed)
