"""LTX-2's video VAE (diffusers ``AutoencoderKLLTX2Video``), written natively.

A causal 3-D conv autoencoder with 32x spatial and 8x temporal compression: the encoder
patchifies 4x4 pixels into channels, space-to-depth downsamplers with averaged residuals,
per-channel RMS norms; the decoder mirrors it with depth-to-space upsamplers. Module names
follow diffusers' so the checkpoint maps one to one.

Shapes: video [B, 3, 8k + 1, H, W] in [-1, 1]; latents [B, C, k + 1, H / 32, W / 32].
Not ported: decoder timestep conditioning and noise injection (no LTX-2.0 checkpoint uses
them; such configs are refused at load), tiled / framewise decoding (the whole clip decodes
at once, as diffusers does by default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


def _tuple(v: Any, n: int) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


@dataclass(frozen=True)
class LTX2VideoVAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
    down_block_types: tuple[str, ...] = ("LTX2VideoDownBlock3D",) * 4
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    spatio_temporal_scaling: Any = (True, True, True, True)
    decoder_spatio_temporal_scaling: Any = (True, True, True)
    decoder_inject_noise: Any = (False, False, False, False)
    downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    upsample_type: tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: Any = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = True
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    def __post_init__(self) -> None:
        if self.timestep_conditioning:
            raise ValueError("LTX-2 video VAE with timestep_conditioning=true (decode-time noise) is not supported")
        if any(_tuple(self.decoder_inject_noise, len(self.decoder_layers_per_block))):
            raise ValueError("LTX-2 video VAE with decoder_inject_noise is not supported (it draws unseeded noise)")
        if any(t != "LTX2VideoDownBlock3D" for t in self.down_block_types):
            raise ValueError(f"unknown down block types {self.down_block_types}")

    @property
    def encoder_scaling(self) -> tuple[bool, ...]:
        return _tuple(self.spatio_temporal_scaling, len(self.layers_per_block) - 1)

    @property
    def spatial_ratio(self) -> int:
        return self.spatial_compression_ratio or self.patch_size * 2 ** sum(self.encoder_scaling)

    @property
    def temporal_ratio(self) -> int:
        return self.temporal_compression_ratio or self.patch_size_t * 2 ** sum(self.encoder_scaling)

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2VideoVAEConfig":
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}  # JSON values
        return cls(**kw)


class PerChannelRMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + 1e-8)


class CausalConv3d(nn.Module):
    """3-D conv padded in time by repeating the first frame (causal) or both end frames."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: Any = 1, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.kernel_t = kernel
        stride = stride if isinstance(stride, tuple) else (stride,) * 3
        self.conv = nn.Conv3d(cin, cout, (kernel,) * 3, stride=stride, padding=(0, kernel // 2, kernel // 2),
                              padding_mode=padding_mode)

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        k = self.kernel_t
        if causal:
            x = torch.concatenate([x[:, :, :1].repeat((1, 1, k - 1, 1, 1)), x], dim=2)
        else:
            pad = (k - 1) // 2
            x = torch.concatenate([x[:, :, :1].repeat((1, 1, pad, 1, 1)), x, x[:, :, -1:].repeat((1, 1, pad, 1, 1))],
                                  dim=2)
        return self.conv(x)


class ResnetBlock3d(nn.Module):
    def __init__(self, cin: int, cout: int, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = PerChannelRMSNorm(), PerChannelRMSNorm()
        self.conv1 = CausalConv3d(cin, cout, padding_mode=padding_mode)
        self.conv2 = CausalConv3d(cout, cout, padding_mode=padding_mode)
        self.norm3 = nn.LayerNorm(cin, eps=eps, elementwise_affine=True, bias=True) if cin != cout else None
        self.conv_shortcut = nn.Conv3d(cin, cout, kernel_size=1, stride=1) if cin != cout else None

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)), causal=causal)
        h = self.conv2(F.silu(self.norm2(h)), causal=causal)
        if self.norm3 is not None:
            x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


class Downsampler3d(nn.Module):
    """Space/time-to-depth by ``stride`` with the grouped channel mean as the residual."""

    def __init__(self, cin: int, cout: int, stride: tuple[int, int, int], padding_mode: str) -> None:
        super().__init__()
        self.stride = stride
        self.group_size = (cin * stride[0] * stride[1] * stride[2]) // cout
        self.conv = CausalConv3d(cin, cout // (stride[0] * stride[1] * stride[2]), padding_mode=padding_mode)

    def _to_depth(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride
        x = x.unflatten(4, (-1, s[2])).unflatten(3, (-1, s[1])).unflatten(2, (-1, s[0]))
        return x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(1, 4)

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        x = torch.cat([x[:, :, : self.stride[0] - 1], x], dim=2)
        residual = self._to_depth(x).unflatten(1, (-1, self.group_size)).mean(dim=2)
        return self._to_depth(self.conv(x, causal=causal)) + residual


class Upsampler3d(nn.Module):
    """Depth-to-space/time by ``stride``; optional channel-repeat residual."""

    def __init__(self, cin: int, stride: tuple[int, int, int], residual: bool, upscale: int, padding_mode: str) -> None:
        super().__init__()
        self.stride, self.residual, self.upscale = stride, residual, upscale
        self.conv = CausalConv3d(cin, (cin * stride[0] * stride[1] * stride[2]) // upscale, padding_mode=padding_mode)

    def _to_space(self, x: torch.Tensor, b: int, f: int, h: int, w: int) -> torch.Tensor:
        s = self.stride
        x = x.reshape(b, -1, s[0], s[1], s[2], f, h, w)
        return x.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        b, _, f, h, w = x.shape
        s = self.stride
        residual = None
        if self.residual:
            residual = self._to_space(x, b, f, h, w).repeat(1, (s[0] * s[1] * s[2]) // self.upscale, 1, 1, 1)
            residual = residual[:, :, s[0] - 1:]
        x = self._to_space(self.conv(x, causal=causal), b, f, h, w)[:, :, s[0] - 1:]
        return x + residual if residual is not None else x


_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, scale: bool, kind: str, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock3d(cin, cin, eps, padding_mode) for _ in range(layers))
        self.downsamplers = None
        if scale:
            if kind == "conv":
                down: nn.Module = CausalConv3d(cin, cin, stride=(2, 2, 2), padding_mode=padding_mode)
            else:
                down = Downsampler3d(cin, cout, _STRIDES[kind], padding_mode)
            self.downsamplers = nn.ModuleList([down])

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        for r in self.resnets:
            x = r(x, causal=causal)
        for d in self.downsamplers or ():
            x = d(x, causal=causal)
        return x


class MidBlock(nn.Module):
    def __init__(self, channels: int, layers: int, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock3d(channels, channels, eps, padding_mode) for _ in range(layers))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        for r in self.resnets:
            x = r(x, causal=causal)
        return x


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, scale: bool, kind: str, residual: bool, upscale: int,
                 eps: float, padding_mode: str) -> None:
        super().__init__()
        self.conv_in = ResnetBlock3d(cin, cout, eps, padding_mode) if cin != cout else None
        self.upsamplers = None
        if scale:
            self.upsamplers = nn.ModuleList([Upsampler3d(cout * upscale, _STRIDES[kind], residual, upscale, padding_mode)])
        self.resnets = nn.ModuleList(ResnetBlock3d(cout, cout, eps, padding_mode) for _ in range(layers))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x, causal=causal)
        for u in self.upsamplers or ():
            x = u(x, causal=causal)
        for r in self.resnets:
            x = r(x, causal=causal)
        return x


class Encoder(nn.Module):
    def __init__(self, c: LTX2VideoVAEConfig) -> None:
        super().__init__()
        self.p, self.p_t, self.causal = c.patch_size, c.patch_size_t, c.encoder_causal
        mode, eps = c.encoder_spatial_padding_mode, c.resnet_norm_eps
        ch = c.latent_channels
        self.conv_in = CausalConv3d(c.in_channels * c.patch_size**2, ch, padding_mode=mode)
        self.down_blocks = nn.ModuleList()
        for i, out in enumerate(c.block_out_channels):
            self.down_blocks.append(DownBlock(ch, out, c.layers_per_block[i], c.encoder_scaling[i], c.downsample_type[i],
                                              eps, mode))
            ch = out
        self.mid_block = MidBlock(ch, c.layers_per_block[-1], eps, mode)
        self.norm_out = PerChannelRMSNorm()
        self.conv_out = CausalConv3d(ch, c.latent_channels + 1, padding_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, pt = self.p, self.p_t
        b, ch, f, h, w = x.shape
        x = x.reshape(b, ch, f // pt, pt, h // p, p, w // p, p).permute(0, 1, 3, 7, 5, 2, 4, 6).flatten(1, 4)
        x = self.conv_in(x, causal=self.causal)
        for block in self.down_blocks:
            x = block(x, self.causal)
        x = self.mid_block(x, self.causal)
        x = self.conv_out(F.silu(self.norm_out(x)), causal=self.causal)
        last = x[:, -1:].repeat(1, x.size(1) - 2, 1, 1, 1)  # the shared log-variance channel
        return torch.cat([x, last], dim=1)


class Decoder(nn.Module):
    def __init__(self, c: LTX2VideoVAEConfig) -> None:
        super().__init__()
        self.p, self.p_t, self.causal = c.patch_size, c.patch_size_t, c.decoder_causal
        mode, eps = c.decoder_spatial_padding_mode, c.resnet_norm_eps
        n = len(c.decoder_layers_per_block)
        channels = tuple(reversed(c.decoder_block_out_channels))
        scaling = tuple(reversed(_tuple(c.decoder_spatio_temporal_scaling, n - 1)))
        layers = tuple(reversed(c.decoder_layers_per_block))
        residual = tuple(reversed(_tuple(c.upsample_residual, n - 1)))
        factor = tuple(reversed(c.upsample_factor))
        out = channels[0]
        self.conv_in = CausalConv3d(c.latent_channels, out, padding_mode=mode)
        self.mid_block = MidBlock(out, layers[0], eps, mode)
        self.up_blocks = nn.ModuleList()
        for i in range(len(channels)):
            cin, out = out // factor[i], channels[i] // factor[i]
            self.up_blocks.append(UpBlock(cin, out, layers[i + 1], scaling[i], c.upsample_type[i], residual[i],
                                          factor[i], eps, mode))
        self.norm_out = PerChannelRMSNorm()
        self.conv_out = CausalConv3d(out, c.out_channels * c.patch_size**2, padding_mode=mode)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z, causal=self.causal), self.causal)
        for block in self.up_blocks:
            x = block(x, self.causal)
        x = self.conv_out(F.silu(self.norm_out(x)), causal=self.causal)
        p, pt = self.p, self.p_t
        b, _, f, h, w = x.shape
        x = x.reshape(b, -1, pt, p, p, f, h, w)
        return x.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class LTX2VideoVAE(nn.Module):
    latents_mean: torch.Tensor  # buffers: [latent_channels]
    latents_std: torch.Tensor

    def __init__(self, config: LTX2VideoVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.register_buffer("latents_mean", torch.zeros(config.latent_channels))
        self.register_buffer("latents_std", torch.ones(config.latent_channels))

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.conv.weight.dtype

    @torch.inference_mode()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] in [-1, 1] -> the posterior mean [B, C, f, h, w] (diffusers' argmax)."""
        moments = self.encoder(video.to(self.dtype))
        return moments.chunk(2, dim=1)[0]

    @torch.inference_mode()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """[B, C, f, h, w] -> video [B, 3, 8(f - 1) + 1, 32 h, 32 w], not clamped."""
        return self.decoder(z.to(self.dtype))

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.latents_mean.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = self.latents_std.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return mean, std

    def normalize(self, z: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """VAE latents -> the DiT's space: ``(z - mean) * scaling / std`` (diffusers' order)."""
        mean, std = self._stats(z)
        return (z - mean) * (self.config.scaling_factor if scaling is None else scaling) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z * std / self.config.scaling_factor + mean
