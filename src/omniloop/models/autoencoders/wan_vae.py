"""The Wan causal 3D VAEs (diffusers ``AutoencoderKLWan``): Wan2.1 and Wan2.2.

Video ``[B, 3, F, H, W]`` in ``[-1, 1]`` <-> latents ``[B, z_dim, f, h, w]`` with
``F = 1 + 4 (f - 1)`` and ``H = 8 h``, ``W = 8 w`` for the released Wan2.1 checkpoint.

Wan2.2's VAE (``is_residual=True``, ``patch_size=2``; z_dim 48, used by Wan2.2 TI2V-5B and
Cosmos3) differs in three ways: pixels are patchified 2x2 into channels before the encoder
(and back after the decoder), so ``H = 16 h``; each encoder level is a residual down block
whose shortcut averages groups of input channels over the (2x)2x2 neighbourhood it
downsamples (``AvgDown3D``); each decoder level is a residual up block whose shortcut
duplicates channels back out (``DupUp3D``), and its upsampler keeps the channel count.

Vocabulary:

* **chunk** -- the unit the causal network runs on. Encoding takes the first frame
  alone, then chunks of ``scale_factor_temporal`` frames, each giving one latent frame;
  decoding takes one latent frame per chunk (the first gives one video frame, every later
  one ``scale_factor_temporal`` frames). This is diffusers' chunking, so outputs match.
* **causal cache** -- the last (up to two) frames each causal conv saw in the previous
  chunk, so a chunk sees the frames before it. It lives in a :class:`CausalCache` that
  ``encode``/``decode`` create per call and thread through every forward; the module
  itself holds only weights, so one module serves concurrent requests (diffusers keeps
  this on the module as ``_feat_map``/``_conv_idx``).

Every block takes ``(x, cache)``. The cache slots are positional: each causal conv (and
each temporal resample) takes the next slot in forward order, every chunk.

NOTE: tensors stored in the cache are sometimes the very tensors that flow on to the next
layer (no copy). So in-place ops below only ever touch tensors created in the same
function (conv / norm outputs), never a block's input.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniloop.models.checkpoint_files import (cast_to, check_and_assign, format_keys, read_tensors, weight_files,
                                             wrong_shapes)
from omniloop.models.layers.norm_silu_triton import norm_silu_into, runs_on as norm_silu_runs_on
from omniloop.models.single_file import VAE_SECTIONS, read_single_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"

# The Wan2.1 latent statistics (diffusers' defaults; WanPipeline normalises with them).
WAN21_LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

# The Wan2.2 VAE's latent statistics (Wan2.2 TI2V-5B; not in its single file, so fixed here).
WAN22_LATENTS_MEAN: tuple[float, ...] = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD: tuple[float, ...] = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# Frames of history a 3-tap causal conv needs (diffusers' CACHE_T).
_HISTORY = 2
# ``decode(whole=None)`` decodes in one chunk up to this largest activation (1 GiB in fp32).
WHOLE_DECODE_MAX_ELEMENTS = 2**28


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class WanVAEConfig:
    """Architecture of the Wan2.1 VAE; the defaults are the released checkpoint."""

    base_dim: int = 96
    decoder_base_dim: int | None = None  # None: same as base_dim
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()  # encoder levels (1.0, 0.5, ...) with attention
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # sic: diffusers' spelling
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    in_channels: int = 3
    out_channels: int = 3
    is_residual: bool = False  # Wan2.2: residual down/up blocks with averaging / duplicating shortcuts
    patch_size: int | None = None  # Wan2.2: pixels patchified p x p into channels around the network

    def __post_init__(self) -> None:
        for name in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"WanVAEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.decoder_base_dim is not None and self.decoder_base_dim < 1:
            raise ValueError(
                f"WanVAEConfig.decoder_base_dim must be >= 1 or None (same as base_dim), "
                f"got {self.decoder_base_dim}"
            )
        if not self.dim_mult or any(m < 1 for m in self.dim_mult):
            raise ValueError(f"WanVAEConfig.dim_mult must be a non-empty list of ints >= 1, got {self.dim_mult}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"WanVAEConfig.temperal_downsample needs one bool per downsampling level "
                f"(len(dim_mult) - 1 = {len(self.dim_mult) - 1}), got {list(self.temperal_downsample)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"WanVAEConfig.dropout must be in [0, 1), got {self.dropout}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(
                f"WanVAEConfig.latents_mean/latents_std need z_dim={self.z_dim} values each, got "
                f"{len(self.latents_mean)} and {len(self.latents_std)}"
            )
        if any(s <= 0 for s in self.latents_std):
            raise ValueError(f"WanVAEConfig.latents_std must be positive, got {self.latents_std}")
        if self.patch_size is not None and self.patch_size < 1:
            raise ValueError(f"WanVAEConfig.patch_size must be >= 1 or None, got {self.patch_size}")

    @property
    def decoder_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @property
    def scale_factor_temporal(self) -> int:
        """Video frames per latent frame (after the first): 4 for Wan2.1."""
        return 2 ** sum(self.temperal_downsample)

    @property
    def scale_factor_spatial(self) -> int:
        """Pixels per latent along H and W: 8 for Wan2.1, 16 for Wan2.2 (patchified)."""
        return 2 ** (len(self.dim_mult) - 1) * (self.patch_size or 1)

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> WanVAEConfig:
        """Build from a diffusers ``vae/config.json`` dict (``AutoencoderKLWan``)."""
        d = {k: v for k, v in d.items() if not k.startswith("_")}  # _class_name, _diffusers_version, ...
        # The scale factors are derived from the architecture; a config may restate them.
        probe = {k: d.pop(k) for k in ("scale_factor_temporal", "scale_factor_spatial") if k in d}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Wan VAE config keys {unknown}; known keys are {sorted(known)}")
        for key in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            if key in d:
                d[key] = tuple(d[key])
        config = cls(**d)
        for key, value in probe.items():
            if value is not None and value != getattr(config, key):
                raise ValueError(
                    f"Wan VAE config says {key}={value} but its architecture gives "
                    f"{getattr(config, key)}; fix or drop {key}"
                )
        return config


# ----------------------------------------------------------------------------- cache


class CausalCache:
    """Per-stream history of every causal layer: one slot per layer, in forward order.

    Create one per ``encode``/``decode`` call (or per streamed video), call
    :meth:`begin_chunk` before each chunk, and pass it down every forward. A slot holds
    ``None`` before its layer first ran, then the frames the layer must see before the
    next chunk.
    """

    __slots__ = ("_slots", "_index", "chunks")

    def __init__(self) -> None:
        self._slots: list[Tensor | None] = []
        self._index = 0
        self.chunks = 0  # chunks begun so far

    def begin_chunk(self) -> None:
        assert self.chunks == 0 or self._index == len(self._slots), (
            f"chunk {self.chunks} used {self._index} of {len(self._slots)} cache slots"
        )
        self._index = 0
        self.chunks += 1

    def read(self) -> Tensor | None:
        """History of the current layer (``None`` in its first chunk); call :meth:`write` next."""
        if self._index == len(self._slots):
            assert self.chunks == 1, f"cache slot {self._index} first used in chunk {self.chunks}"
            self._slots.append(None)
        return self._slots[self._index]

    def write(self, frames: Tensor) -> None:
        """Store the current layer's history for the next chunk and move to the next layer."""
        self._slots[self._index] = frames
        self._index += 1


def _history(prev: Tensor | None, x: Tensor, keep: int) -> Tensor:
    """The last ``keep`` frames of ``prev ++ x`` (fewer when there are fewer): [B, C, <=keep, H, W]."""
    t = x.shape[2]
    if t > keep:
        return x[:, :, -keep:].clone()  # clone: a view would pin the whole chunk
    if t == keep or prev is None or prev.shape[2] == 0:
        return x
    return torch.cat([prev[:, :, t - keep :], x], dim=2)


# ----------------------------------------------------------------------------- layers


class ChannelRMSNorm(nn.Module):
    """RMS norm over channels (dim 1) of a channel-first tensor, times ``sqrt(C) * weight``.

    Equals diffusers' ``WanRMS_norm`` (``F.normalize(x) * C**0.5 * gamma``). For bf16/fp16
    only the norm is computed in fp32 ([B, 1, ...], C times smaller than x) instead of an
    fp32 copy of all of x.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))  # diffusers: gamma [C, 1, 1(, 1)]

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, *spatial]
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32)  # [B, 1, *spatial]
        # out of place: autograd needs the norm for its backward ([B, 1, ...], cheap)
        inv = norm.clamp_min(1e-12).reciprocal().to(x.dtype)
        scale = (self.weight * self.dim**0.5).to(x.dtype).view(-1, *([1] * (x.dim() - 2)))  # [C, 1, ...]
        return (x * inv).mul_(scale)


def _silu(x: Tensor) -> Tensor:
    # In place when no graph needs x (x is always a fresh norm output here).
    return F.silu(x, inplace=not x.requires_grad)


class CausalConv3d(nn.Conv3d):
    """3D conv, causal in time: ``2 * padding_t`` frames of history before each chunk.

    The history comes from the cache (the previous chunk's last frames), zero frames where
    there is none yet. H/W are zero-padded by the conv itself (no padded copy of x).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        pad = self.padding  # (t, h, w): int paddings, never a string mode
        assert isinstance(pad, tuple), f"CausalConv3d takes int paddings, got {pad!r}"
        self.history: int = 2 * pad[0]
        self.padding = (0, pad[1], pad[2])

    def forward(self, x: Tensor, prev: Tensor | None = None) -> Tensor:
        # x: [B, C, T, H, W]; prev: [B, C, <=history, H, W] frames just before x.
        n_prev = 0 if prev is None else prev.shape[2]
        assert n_prev <= self.history, f"{n_prev} history frames for a conv that takes {self.history}"
        parts = [x]
        if prev is not None and n_prev:
            parts.insert(0, prev)
        if n_prev < self.history:
            b, c, _, h, w = x.shape
            parts.insert(0, x.new_zeros(b, c, self.history - n_prev, h, w))
        if len(parts) > 1:
            x = torch.cat(parts, dim=2)  # [B, C, history + T, H, W]
        return F.conv3d(x, self.weight, self.bias, self.stride, self.padding)

    def forward_cached(self, x: Tensor, cache: CausalCache) -> Tensor:
        """Run on one chunk, taking this conv's history from ``cache`` and leaving x's tail there."""
        prev = cache.read()
        cache.write(_history(prev, x, self.history))
        return self(x, prev)


# The fused norm -> SiLU -> padded-input pass's implementations (WanVAE.use_fused)
FusedKernel = Literal["inductor", "triton"]
FUSED_KERNELS: tuple[FusedKernel, ...] = get_args(FusedKernel)


def norm_silu_padded(x: Tensor, scale: Tensor, prev: Tensor | None, history: int) -> tuple[Tensor, Tensor]:
    """A causal conv's padded input ``cat([prev or zeros, silu(ChannelRMSNorm(x))], dim=2)`` and its
    next history (the padded input's last ``history`` frames), as plain math for ``torch.compile``.

    x: [B, C, T, H, W]; scale: [C] fp32, the norm's ``sqrt(C) * weight`` (made outside: ``C ** 0.5``
    in here would make Dynamo specialise on C, a graph per width); prev: [B, C, history, H, W] or
    None (zeros).
    Returns ([B, C, history + T, H, W], [B, C, history, H, W]), both in x's dtype. In fp32 inside
    and cast once (the eager path rounds the inverse norm and the scale to x's dtype first), so
    the two differ by rounding only. Compiled (:func:`_compiled_norm_silu_padded`), Inductor
    lowers the cat to slice writes: the norm's reduction and one pointwise pass that writes the
    padded input, where eager makes five passes over the activation (norm, scale, weight, SiLU, cat).
    """
    b, c, _, h, w = x.shape
    xf = x.float()
    inv = torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(1e-12).reciprocal()  # [B, 1, T, H, W]
    y = F.silu(xf * inv * scale.view(-1, 1, 1, 1)).to(x.dtype)
    head = x.new_zeros(b, c, history, h, w) if prev is None else prev
    padded = torch.cat([head, y], dim=2)
    return padded, padded[:, :, padded.shape[2] - history :].clone()  # clone: a view would pin the chunk


@functools.cache
def _compiled_norm_silu_padded() -> Callable[[Tensor, Tensor, Tensor | None, int], tuple[Tensor, Tensor]]:
    # Built on first use, so an eager deployment never imports Dynamo for it. dynamic: one graph
    # for every width and size (four in all: Dynamo specialises T == 1 and prev None).
    return torch.compile(norm_silu_padded, dynamic=True)


def _triton_norm_silu_padded(x: Tensor, scale: Tensor, prev: Tensor | None, history: int) -> tuple[Tensor, Tensor]:
    """:func:`norm_silu_padded` with the history frames copied in and the rest written by the Triton
    kernel straight into the padded buffer (no cat)."""
    b, c, t, h, w = x.shape
    padded = x.new_empty(b, c, history + t, h, w)
    if prev is None:
        padded[:, :, :history].zero_()
    else:
        padded[:, :, :history] = prev
    norm_silu_into(x.contiguous(), scale, padded, history)
    return padded, padded[:, :, padded.shape[2] - history :].clone()  # clone: a view would pin the chunk


def _fusable(norm: ChannelRMSNorm, x: Tensor, dropout: nn.Dropout | None) -> bool:
    """Whether the fused path computes what the eager one would: no autograd graph to record
    (training stays eager) and dropout, if any, the identity."""
    grads = torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad)
    return not grads and (dropout is None or not dropout.training or dropout.p == 0.0)


def norm_silu_conv(norm: ChannelRMSNorm, conv: CausalConv3d, x: Tensor, cache: CausalCache, *,
                   fused: FusedKernel | None, dropout: nn.Dropout | None = None) -> Tensor:
    """``conv(dropout(silu(norm(x))))`` on one chunk through ``cache`` (every norm -> SiLU -> causal
    conv site). ``fused`` (:meth:`WanVAE.use_fused`): the conv's padded input and its next history
    in one pass where :func:`_fusable` (the compiled :func:`norm_silu_padded`, or the Triton
    kernel), else (None) the eager layers."""
    if not (fused and _fusable(norm, x, dropout)):
        h = _silu(norm(x))
        return conv.forward_cached(h if dropout is None else dropout(h), cache)
    prev = cache.read()
    if prev is not None and prev.shape[2] < conv.history:  # an eager chunk's shorter history: zeros before it
        prev = torch.cat([prev.new_zeros(*prev.shape[:2], conv.history - prev.shape[2], *prev.shape[3:]), prev], 2)
    scale = norm.weight.float() * norm.dim**0.5  # [C]
    if fused == "triton":
        padded, history = _triton_norm_silu_padded(x, scale, prev, conv.history)
    else:
        padded, history = _compiled_norm_silu_padded()(x, scale, prev, conv.history)
    cache.write(history)  # always conv.history frames (zeros first): the same conv input next chunk
    return F.conv3d(padded, conv.weight, conv.bias, conv.stride, conv.padding)


def _conv2d_per_frame(conv: nn.Conv2d, x: Tensor, stride: int = 1, padding: int = 0) -> Tensor:
    """A 2D conv applied to every frame of [B, C, T, H, W], as a (1, k, k) conv3d: no permutes."""
    return F.conv3d(x, conv.weight.unsqueeze(2), conv.bias, (1, stride, stride), (0, padding, padding))


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = ChannelRMSNorm(in_dim)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = ChannelRMSNorm(out_dim)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    fused: FusedKernel | None = None  # set by WanVAE.use_fused

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        # x: [B, C_in, T, H, W] -> [B, C_out, T, H, W]
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = norm_silu_conv(self.norm1, self.conv1, x, cache, fused=self.fused)
        h = norm_silu_conv(self.norm2, self.conv2, h, cache, fused=self.fused, dropout=self.dropout)
        return h.add_(shortcut)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each frame (no cache: per frame)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        b, c, t, h, w = x.shape
        y = self.norm(x).permute(0, 2, 3, 4, 1).reshape(b * t, h * w, c)  # [BT, HW, C]
        qkv = F.linear(y, self.to_qkv.weight.view(3 * c, c), self.to_qkv.bias)  # [BT, HW, 3C]
        q, k, v = qkv.unsqueeze(1).chunk(3, dim=-1)  # [BT, 1, HW, C] each
        # NOTE: head_dim = C (384 in Wan2.1) is past flash attention's limit; SDPA picks
        # another kernel. Only the two mid blocks attend, at the lowest resolution.
        y = F.scaled_dot_product_attention(q, k, v).squeeze(1)  # [BT, HW, C]
        y = F.linear(y, self.proj.weight.view(c, c), self.proj.bias)
        y = y.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)  # [B, C, T, H, W] (strided view)
        return torch.add(x, y)  # x first: the sum takes x's contiguous layout


class Downsample(nn.Module):
    """Halve H and W (stride-2 conv); with ``temporal`` also halve T (causal stride-2 conv).

    Temporal: the first chunk (one frame) is not downsampled in time; every later chunk of
    T frames is prefixed with the last frame of the chunk before and gives T / 2 frames.
    """

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.spatial_conv = nn.Conv2d(dim, dim, 3, stride=2)
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        # [B, C, T, H, W] -> [B, C, T', ceil(H/2), ceil(W/2)]; zero-pad right/bottom like diffusers.
        x = _conv2d_per_frame(self.spatial_conv, F.pad(x, (0, 1, 0, 1)), stride=2)
        if self.time_conv is None:
            return x
        prev = cache.read()
        cache.write(_history(prev, x, 1))
        if prev is None:
            if x.shape[2] == 1:
                return x
            # whole video in one chunk: frame 0 passes, then stride-2 windows from frame 0 on
            # ((x0, x1, x2), (x2, x3, x4), ...), exactly what the chunked path computes
            return torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)
        return self.time_conv(torch.cat([prev, x], dim=2))


class Upsample(nn.Module):
    """Double H and W (nearest + conv, halving channels); with ``temporal`` also double T.

    Temporal: a causal conv makes 2C channels that are interleaved into 2T frames, except in
    the first chunk, whose single latent frame stays one frame.
    """

    def __init__(self, dim: int, temporal: bool, out_dim: int | None = None) -> None:
        super().__init__()
        self.spatial_conv = nn.Conv2d(dim, dim // 2 if out_dim is None else out_dim, 3, padding=1)
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0)) if temporal else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        b, c, t, h, w = x.shape
        if self.time_conv is not None:
            prev = cache.read()
            if prev is None:
                # First chunk: no time conv on its first frame; the frames after it start from
                # zero history, not from it (more than one frame: a whole video in one chunk).
                first, rest = x[:, :, :1], x[:, :, 1:]
                cache.write(_history(x.new_empty(b, c, 0, h, w), rest, self.time_conv.history))
                if t > 1:
                    x = torch.cat([first, self._double_time(self.time_conv(rest))], dim=2)
                    t = 1 + 2 * (t - 1)
            else:
                cache.write(_history(prev, x, self.time_conv.history))
                x = self._double_time(self.time_conv(x, prev))
                t *= 2
        # nearest-exact 2x == repeat every pixel 2x2 (exact in any dtype; diffusers upcasts).
        x = x[:, :, :, :, None, :, None].expand(b, c, t, h, 2, w, 2).reshape(b, c, t, 2 * h, 2 * w)
        return _conv2d_per_frame(self.spatial_conv, x, padding=1)  # [B, C/2 (Wan2.2: C), T', 2H, 2W]

    @staticmethod
    def _double_time(x: Tensor) -> Tensor:
        """[B, 2C, T, H, W] time-conv output -> [B, C, 2T, H, W]: each frame's two halves in turn."""
        b, c2, t, h, w = x.shape
        return x.view(b, 2, c2 // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c2 // 2, 2 * t, h, w)


class MidBlock(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout), ResidualBlock(dim, dim, dropout)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x, cache)
        return self.resnets[1](x, cache)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample: str | None) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList(ResidualBlock(i, o, dropout) for i, o in zip(dims[:-1], dims[1:]))
        self.upsampler = None if upsample is None else Upsample(out_dim, temporal=upsample == "3d")

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        return x if self.upsampler is None else self.upsampler(x, cache)


def avg_down(x: Tensor, out_dim: int, factor_t: int, factor_s: int) -> Tensor:
    """Wan2.2's shortcut down: [B, C, T, H, W] -> [B, out_dim, T/ft, H/fs, W/fs], the mean of
    each group of ``C * ft * fs * fs / out_dim`` values of the (ft, fs, fs) neighbourhood's
    channels (T zero-padded in front to a multiple of ``ft``, as diffusers' ``AvgDown3D``)."""
    pad_t = (factor_t - x.shape[2] % factor_t) % factor_t
    if pad_t:
        x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, c * factor_t * factor_s * factor_s, t // factor_t, h // factor_s, w // factor_s)
    return x.view(b, out_dim, -1, t // factor_t, h // factor_s, w // factor_s).mean(dim=2)


def dup_up(x: Tensor, out_dim: int, factor_t: int, factor_s: int, first_chunk: bool) -> Tensor:
    """Wan2.2's shortcut up (diffusers' ``DupUp3D``): repeat channels, unfold them into a
    (ft, fs, fs) neighbourhood; the first chunk drops the ``ft - 1`` leading frames."""
    b, c, t, h, w = x.shape
    factor = factor_t * factor_s * factor_s
    x = x.repeat_interleave(out_dim * factor // c, dim=1)
    x = x.view(b, out_dim, factor_t, factor_s, factor_s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, out_dim, t * factor_t, h * factor_s, w * factor_s)
    return x[:, :, factor_t - 1:] if first_chunk else x


class ResidualDownBlock(nn.Module):
    """Wan2.2 encoder level: residual blocks + downsample, plus the channel-averaging shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, temporal: bool, down: bool) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(ResidualBlock(i, o, dropout) for i, o in zip(dims[:-1], dims[1:]))
        self.downsampler = Downsample(out_dim, temporal=temporal) if down else None
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        shortcut = avg_down(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + shortcut


class ResidualUpBlock(nn.Module):
    """Wan2.2 decoder level: residual blocks + upsample (channels kept), plus the duplicating shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample: str | None) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList(ResidualBlock(i, o, dropout) for i, o in zip(dims[:-1], dims[1:]))
        self.upsampler = None if upsample is None else Upsample(out_dim, temporal=upsample == "3d", out_dim=out_dim)
        self.out_dim, self.factor_t = out_dim, 2 if upsample == "3d" else 1

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        shortcut = None
        if self.upsampler is not None:  # cache.chunks == 1: the first chunk of this decode
            shortcut = dup_up(x, self.out_dim, self.factor_t, 2, first_chunk=cache.chunks == 1)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is not None:
            x = self.upsampler(x, cache)
        return x if shortcut is None else x + shortcut


class Encoder3d(nn.Module):
    """[B, in_channels, T, H, W] chunk -> [B, 2 z_dim, T', H/8, W/8] (mean and logvar)."""

    fused: FusedKernel | None = None  # set by WanVAE.use_fused (the head's norm -> SiLU -> conv)

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        self.conv_in = CausalConv3d(config.in_channels, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        scale = 1.0
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            last = level == len(config.dim_mult) - 1
            if config.is_residual:
                temporal = config.temperal_downsample[level] if not last else False
                blocks.append(ResidualDownBlock(in_dim, out_dim, config.num_res_blocks, config.dropout, temporal, not last))
                continue
            for _ in range(config.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, config.dropout))
                if scale in config.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if level != len(config.dim_mult) - 1:
                blocks.append(Downsample(out_dim, temporal=config.temperal_downsample[level]))
                scale /= 2.0
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1], config.dropout)
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 2 * config.z_dim, 3, padding=1)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.conv_in.forward_cached(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return norm_silu_conv(self.norm_out, self.conv_out, x, cache, fused=self.fused)


class Decoder3d(nn.Module):
    """[B, z_dim, 1, h, w] chunk -> [B, out_channels, 1 or 4, 8h, 8w]."""

    fused: FusedKernel | None = None  # set by WanVAE.use_fused (the head's norm -> SiLU -> conv)

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        mult = config.dim_mult
        dims = [config.decoder_dim * m for m in (mult[-1], *reversed(mult))]
        temporal_upsample = tuple(reversed(config.temperal_downsample))
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0], config.dropout)
        blocks = []
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if level > 0 and not config.is_residual:
                in_dim //= 2  # the previous level's upsampler halved the channels (Wan2.1)
            upsample = None
            if level != len(mult) - 1:
                upsample = "3d" if temporal_upsample[level] else "2d"
            block = ResidualUpBlock if config.is_residual else UpBlock
            blocks.append(block(in_dim, out_dim, config.num_res_blocks, config.dropout, upsample))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3, padding=1)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.conv_in.forward_cached(x, cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return norm_silu_conv(self.norm_out, self.conv_out, x, cache, fused=self.fused)


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True, kw_only=True)
class WanVAETiling:
    """Spatial tiling for :meth:`WanVAE.decode`: decode overlapping tiles, blend the seams.

    Sizes are in output pixels (diffusers' ``tile_sample_min_*`` / ``tile_sample_stride_*``
    defaults). Bounds peak memory by the tile size instead of the frame size; the output
    differs slightly from an untiled decode near the seams (same as diffusers).
    """

    tile_height: int = 256
    tile_width: int = 256
    stride_height: int = 192
    stride_width: int = 192

    def __post_init__(self) -> None:
        for name in ("tile_height", "tile_width", "stride_height", "stride_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"WanVAETiling.{name} must be >= 1, got {getattr(self, name)}")
        if self.stride_height > self.tile_height or self.stride_width > self.tile_width:
            raise ValueError(
                f"WanVAETiling strides ({self.stride_height}, {self.stride_width}) must not exceed the tile "
                f"size ({self.tile_height}, {self.tile_width}); pass smaller strides to get overlap"
            )


class WanVAE(nn.Module):
    """The Wan2.1 video VAE. Holds only weights: every call brings its own :class:`CausalCache`."""

    # decode_stream equals decode(whole=False) bit for bit (a decode loop may stream it)
    streams_frames: bool = True
    # Deployment state (like a DiT's attention_backend), never per request: see use_fused.
    fused: FusedKernel | None = None

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder3d(config)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder3d(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    def use_fused(self, enabled: bool = True, kernel: FusedKernel = "inductor") -> WanVAE:
        """Every norm -> SiLU -> causal conv (the residual blocks and both heads) builds the conv's
        padded input in one pass (:func:`norm_silu_conv`) instead of four eager ones. The same
        function up to float rounding. ``kernel``: "inductor" compiles :func:`norm_silu_padded` on
        first use (a C compiler on CPU, Triton on CUDA); "triton" writes the padded input with the
        hand-written kernel of :mod:`omniloop.models.layers.norm_silu_triton` (CUDA, or the CPU
        under ``TRITON_INTERPRET=1``). Calls that record gradients stay eager."""
        if kernel not in FUSED_KERNELS:
            raise ValueError(f"fused kernel {kernel!r}: pass one of {list(FUSED_KERNELS)}")
        if enabled and kernel == "triton" and not norm_silu_runs_on(self.quant_conv.weight.device):
            raise ValueError(f"the triton fused kernel needs Triton and a CUDA device (this VAE is on "
                             f"{self.quant_conv.weight.device}); pass kernel='inductor'")
        for module in self.modules():
            if isinstance(module, (WanVAE, Encoder3d, Decoder3d, ResidualBlock)):
                module.fused = kernel if enabled else None
        return self

    # -- streaming API: one chunk at a time, state in the caller's cache ------------------

    def new_stream(self) -> CausalCache:
        """The per-stream state of :meth:`decode_stream` (one per request: never on the module)."""
        return CausalCache()

    def decode_stream(self, z: Tensor, cache: CausalCache, *, one_chunk: bool = False) -> Tensor:
        """The next latent frames [B, z_dim, f, h, w] of a stream -> their video frames in
        [-1, 1]; decoding a video's latents piece by piece with one cache gives exactly
        :meth:`decode` of the whole video (the same per-frame chunks, clamped alike).

        ``one_chunk``: ``z``'s frames as one chunk (the stream's first frame still alone): a
        stream of k frames a piece then equals ``decode(chunk_frames=k)`` (the same chunks)."""
        if not one_chunk:
            return torch.cat([self.decode_chunk(z[:, :, i : i + 1], cache) for i in range(z.shape[2])], dim=2)
        pieces = [z[:, :, :1], z[:, :, 1:]] if cache.chunks == 0 else [z]
        out = [unpatchify(self._decode_piece(piece, cache), self.config.patch) for piece in pieces if piece.shape[2]]
        return torch.cat(out, dim=2).clamp_(-1.0, 1.0)

    def encode_chunk(self, video: Tensor, cache: CausalCache) -> Tensor:
        """One encoder chunk -> its latent moments.

        ``video``: [B, C, 1, H, W] for the first chunk of ``cache``, [B, C, 4, H, W] after
        (4 = ``scale_factor_temporal``). Returns [B, 2 z_dim, 1, H/8, W/8]: mean ++ raw logvar.
        """
        want = 1 if cache.chunks == 0 else self.config.scale_factor_temporal
        if video.shape[2] != want:
            raise ValueError(
                f"encode_chunk needs {want} frame(s) for chunk {cache.chunks}, got {video.shape[2]}; "
                f"pass the first frame alone, then {self.config.scale_factor_temporal} frames per chunk"
            )
        cache.begin_chunk()
        return self.quant_conv(self.encoder(patchify(video.to(self.dtype), self.config.patch), cache))

    def decode_chunk(self, z: Tensor, cache: CausalCache) -> Tensor:
        """One latent frame [B, z_dim, 1, h, w] -> [B, C, 1 (first chunk) or 4, 8h, 8w], clamped to [-1, 1]."""
        return self._decode_chunk(z, cache).clamp_(-1.0, 1.0)

    def _decode_chunk(self, z: Tensor, cache: CausalCache) -> Tensor:
        if z.shape[2] != 1:
            raise ValueError(f"decode_chunk takes one latent frame [B, z_dim, 1, h, w], got shape {tuple(z.shape)}")
        return unpatchify(self._decode_piece(z, cache), self.config.patch)

    def _decode_piece(self, z: Tensor, cache: CausalCache) -> Tensor:
        """Latent frames [B, z_dim, k, h, w] as the next chunk of ``cache`` -> their frames, before
        the unpatchify and unclamped (the one decoder call every decode path makes)."""
        cache.begin_chunk()
        return self.decoder(self.post_quant_conv(z.to(self.dtype)), cache)

    # -- whole-video API ---------------------------------------------------------------------

    def encode(self, video: Tensor, *, whole: bool = False) -> tuple[Tensor, Tensor]:
        """Video [B, C, F, H, W] in [-1, 1] -> (mean, logvar), each [B, z_dim, f, H/8, W/8].

        ``F = 1 + 4 (f - 1)``; ``logvar`` is clamped to [-30, 20] like diffusers'
        ``DiagonalGaussianDistribution``. ``whole``: run all frames as one chunk -- the same
        function (every layer is causal; equal to the chunked path up to float rounding),
        with activations for all frames at once but ~``f`` times fewer kernel launches
        (what training on short clips wants; the chunked default bounds memory).
        """
        self._check_video(video)
        n = self.config.scale_factor_temporal
        cache = CausalCache()
        if whole:
            cache.begin_chunk()
            moments = self.quant_conv(self.encoder(patchify(video.to(self.dtype), self.config.patch), cache))
            mean, logvar = moments.chunk(2, dim=1)
            return mean, logvar.clamp(-30.0, 20.0)
        chunks = [self.encode_chunk(video[:, :, :1], cache)]
        for start in range(1, video.shape[2], n):
            chunks.append(self.encode_chunk(video[:, :, start : start + n], cache))
        moments = torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0]  # [B, 2 z_dim, f, h, w]
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, z: Tensor, tiling: WanVAETiling | None = None, *, whole: bool | None = False,
               map_tiles: TileMap | None = None, chunk_frames: int = 1) -> Tensor:
        """Latents [B, z_dim, f, h, w] -> video [B, C, 1 + 4 (f - 1), 8h, 8w] in [-1, 1].

        With ``tiling``, decodes overlapping spatial tiles and blends them (less memory);
        ``map_tiles(decode, tiles)`` decodes the list of latent tiles (default: one after the
        other; a parallel pool spreads them across ranks, ``omniloop.parallel.vae``).
        ``whole``: all latent frames as one chunk (see :meth:`encode`); ``None``: as one chunk
        when the largest activation is small (:meth:`whole_fits`), else chunk by chunk.
        ``chunk_frames``: latent frames per chunk after the first (see :meth:`_decode_patched`).
        """
        if z.dim() != 5 or z.shape[1] != self.config.z_dim or z.shape[2] < 1:
            raise ValueError(f"decode takes latents [B, {self.config.z_dim}, f >= 1, h, w], got shape {tuple(z.shape)}")
        if whole is None:
            whole = self.whole_fits(z)
        if tiling is not None:
            return self._decode_tiled(z, tiling, map_tiles or _each_tile).clamp_(-1.0, 1.0)
        return self._decode_frames(z, whole=whole, chunk_frames=chunk_frames).clamp_(-1.0, 1.0)

    def whole_fits(self, z: Tensor) -> bool:
        """Whether decoding ``z`` as one chunk keeps the largest activation (the last decoder
        level: batch x decoder_dim x F x H x W) within ``WHOLE_DECODE_MAX_ELEMENTS``.

        NOTE: measured on a 2-core CPU, decoding a 17x128x128 video of the shapes VAE as one
        chunk took 1.4 s against 6.8 s chunk by chunk (bigger convolutions, no cache copies);
        a 480x832x81 Wan2.1 video (3.1G elements at that level) still goes chunk by chunk.
        """
        b, _, f, h, w = z.shape
        s, n = self.config.scale_factor_spatial, self.config.scale_factor_temporal
        return b * self.config.decoder_dim * (1 + n * (f - 1)) * s * h * s * w <= WHOLE_DECODE_MAX_ELEMENTS

    def _decode_frames(self, z: Tensor, *, whole: bool = False, chunk_frames: int = 1) -> Tensor:
        """Untiled, unclamped decode of all latent frames: [B, C, 1 + 4 (f - 1), 8h, 8w]."""
        return unpatchify(self._decode_patched(z, whole=whole, chunk_frames=chunk_frames), self.config.patch)

    def _decode_patched(self, z: Tensor, *, whole: bool = False, chunk_frames: int = 1) -> Tensor:
        """:meth:`_decode_frames` before the unpatchify (Wan2.2: [B, 12, F, H/2, W/2]).

        ``chunk_frames`` k: the first latent frame alone, then latent frames [1, k), [k, 2k),
        [2k, 3k), ... one chunk each (the boundaries a stream stepping k frames at a time with
        ``decode_stream(one_chunk=True)`` has: both decode alike). 1 is diffusers' per-frame
        decode, bit for bit; more is the same function up to float rounding (every layer is
        causal through the cache) with fewer, larger convolutions: on an H100 in bf16 at
        480x832x81, chunks of 4 decode in 1.28 s against 1.55 s one frame at a time (diffusers:
        2.06 s), max |diff| 0.05 in [-1, 1] (benchmarks/results/vae_decode_h100.jsonl; measured
        with the chunks [1, 5), [5, 9), ... before the boundaries moved to multiples of k).
        """
        if whole:
            return self._decode_piece(z, CausalCache())
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        b, _, f, h, w = z.shape
        n, p = self.config.scale_factor_temporal, self.config.patch
        s = self.config.scale_factor_spatial // p
        # Preallocated: no growing cat (diffusers re-copies the video once per latent frame).
        out = z.new_empty(b, self.config.out_channels, 1 + n * (f - 1), s * h, s * w, dtype=self.dtype)
        cache = CausalCache()
        edges = sorted({0, 1, *range(chunk_frames, f, chunk_frames), f})
        for i, j in zip(edges[:-1], edges[1:]):
            frames = self._decode_piece(z[:, :, i:j], cache)
            start = 0 if i == 0 else 1 + n * (i - 1)
            out[:, :, start : start + frames.shape[2]] = frames
        return out

    def _decode_tiled(self, z: Tensor, tiling: WanVAETiling, map_tiles: TileMap) -> Tensor:
        # Same tiles and blending as diffusers' ``tiled_decode``; a patchified (Wan2.2) VAE's
        # tiles are blended before the unpatchify, in its p-times smaller pixel grid.
        s, p = self.config.scale_factor_spatial, self.config.patch
        _, _, _, h, w = z.shape
        tile_h, tile_w = tiling.tile_height // s, tiling.tile_width // s  # latent tile size
        step_h, step_w = tiling.stride_height // s, tiling.stride_width // s  # latent stride
        stride_h, stride_w = tiling.stride_height // p, tiling.stride_width // p  # decoded tile stride
        blend_h, blend_w = tiling.tile_height // p - stride_h, tiling.tile_width // p - stride_w
        if h <= tile_h and w <= tile_w:
            return self._decode_frames(z)
        starts_h, starts_w = range(0, h, step_h), range(0, w, step_w)
        tiles = [z[:, :, :, i : i + tile_h, j : j + tile_w] for i in starts_h for j in starts_w]  # row-major
        decoded = map_tiles(self._decode_patched, tiles)
        rows = [decoded[r * len(starts_w):(r + 1) * len(starts_w)] for r in range(len(starts_h))]
        out_rows = []
        for i, row in enumerate(rows):
            for j, tile in enumerate(row):
                if i > 0:
                    _blend_into(rows[i - 1][j], tile, blend_h, dim=3)
                if j > 0:
                    _blend_into(row[j - 1], tile, blend_w, dim=4)
            out_rows.append(torch.cat([t[:, :, :, :stride_h, :stride_w] for t in row], dim=4))
        return unpatchify(torch.cat(out_rows, dim=3)[:, :, :, : h * s // p, : w * s // p], p)

    # -- latent normalisation (WanPipeline's convention) --------------------------------------

    def normalize_latents(self, z: Tensor) -> Tensor:
        """VAE latents -> the DiT's latent space: ``(z - mean) * (1 / std)`` per channel."""
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std

    def denormalize_latents(self, z: Tensor) -> Tensor:
        """The DiT's latent space -> VAE latents: ``z / (1 / std) + mean`` (what ``decode`` takes)."""
        mean, inv_std = self._latent_stats(z)
        return z / inv_std + mean

    def _latent_stats(self, z: Tensor) -> tuple[Tensor, Tensor]:
        # [1, z_dim, 1, 1, 1] each; 1/std in fp32, then cast, like WanPipeline.
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32).view(shape)
        inv_std = 1.0 / torch.tensor(self.config.latents_std, dtype=torch.float32).view(shape)
        return mean.to(z.device, z.dtype), inv_std.to(z.device, z.dtype)

    def _check_video(self, video: Tensor) -> None:
        c, n, s = self.config.in_channels // self.config.patch ** 2, self.config.scale_factor_temporal, self.config.scale_factor_spatial
        if video.dim() != 5 or video.shape[1] != c:
            raise ValueError(f"encode takes video [B, {c}, F, H, W], got shape {tuple(video.shape)}")
        frames, height, width = video.shape[2:]
        if (frames - 1) % n:
            raise ValueError(f"encode needs 1 + {n} k frames (1, {1 + n}, {1 + 2 * n}, ...), got {frames}")
        if height % s or width % s:
            raise ValueError(f"encode needs H and W divisible by {s}, got {height}x{width}")


TileMap = Callable[[Callable[[Tensor], Tensor], list[Tensor]], list[Tensor]]  # (decode, latent tiles) -> decoded


def _each_tile(decode: Callable[[Tensor], Tensor], tiles: list[Tensor]) -> list[Tensor]:
    return [decode(t) for t in tiles]


def patchify(x: Tensor, p: int) -> Tensor:
    """[B, C, F, H, W] -> [B, C p p, F, H/p, W/p] (diffusers' Wan ``patchify`` channel order)."""
    if p == 1:
        return x
    b, c, f, h, w = x.shape
    x = x.view(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, f, h // p, w // p)


def unpatchify(x: Tensor, p: int) -> Tensor:
    """Inverse of :func:`patchify`: [B, C p p, F, h, w] -> [B, C, F, h p, w p]."""
    if p == 1:
        return x
    b, cpp, f, h, w = x.shape
    x = x.view(b, cpp // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), f, h * p, w * p)


def _blend_into(a: Tensor, b: Tensor, extent: int, dim: int) -> None:
    """Linearly fade the end of tile ``a`` into the start of tile ``b`` along ``dim`` (in place on b)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent == 0:
        return
    ramp = torch.arange(extent, device=b.device, dtype=torch.float32) / extent  # [extent], fp32 weights
    ramp = ramp.view([-1 if d == dim else 1 for d in range(b.dim())])
    head = b.narrow(dim, 0, extent)
    tail = a.narrow(dim, a.shape[dim] - extent, extent)
    head.copy_(tail * (1 - ramp) + head * ramp)


# -- the causal 3D VAE (AutoencoderKLWan) ----------------------------------------------
#
# Key layout differences (diffusers -> ours), all in :func:`vae_state_dict_from_diffusers`:
#
# * RMS norms: ``*.gamma`` [C, 1, 1(, 1)] -> ``*.weight`` [C]
# * resample convs: ``*.resample.1.*`` (index 1 of an nn.Sequential after the pad /
#   upsample layer) -> ``*.spatial_conv.*``
# * decoder up blocks: ``up_blocks.{i}.upsamplers.0.*`` -> ``up_blocks.{i}.upsampler.*``
#
# Everything else keeps its name.

_VAE_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.resample\.1\."), ".spatial_conv."),
    (re.compile(r"(up_blocks\.\d+)\.upsamplers\.0\."), r"\1.upsampler."),
)


def vae_state_dict_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKLWan`` state dict -> :class:`WanVAE` state dict.

    Keys it does not know pass through unchanged (the loader reports them as unexpected).
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        for pattern, repl in _VAE_RENAMES:
            key = pattern.sub(repl, key)
        if key.endswith(".gamma"):
            key, tensor = key[: -len("gamma")] + "weight", tensor.reshape(-1)
        out[key] = tensor
    return out


def load_wan_vae(
    folder: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> WanVAE:
    """Build a :class:`WanVAE` from a diffusers ``vae/`` folder, in eval mode, without grads.

    The module is built on ``meta`` and the checkpoint tensors are assigned to it (cast to
    ``dtype`` on ``device`` one at a time), so no random init and no second copy.
    """
    folder = Path(folder)
    config = WanVAEConfig.from_diffusers_config(json.loads(_require(folder, CONFIG_FILE).read_text()))
    with torch.device("meta"):
        model = WanVAE(config)
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "Wan VAE", "; pass the diffusers `vae/` folder")
    sd = vae_state_dict_from_diffusers(read_tensors(files, cast_to(device, dtype)))

    _check_keys(folder, model.state_dict(), sd)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _require(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; pass the checkpoint's diffusers `vae/` folder (it holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILE})"
        )
    return path


def _check_keys(folder: Path, expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys {format_keys(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys {format_keys(unexpected)}")
    if problems:
        raise ValueError(
            f"{folder / WEIGHTS_FILE} does not match a Wan VAE with its {CONFIG_FILE}: "
            + "; ".join(problems)
            + ". Pass the `vae/` folder of a Wan diffusers checkpoint."
        )
    wrong = wrong_shapes(got, expected)
    if wrong:
        raise ValueError(f"{folder / WEIGHTS_FILE}: {len(wrong)} tensors have the wrong shape: {format_keys(wrong)}")




def wan_vae_loader(subfolder: str = "vae") -> Callable[..., WanVAE]:
    """A ``WeightSpec.load`` for the Wan VAE in ``subfolder`` of a checkpoint (eval, frozen):
    the Wan, FAR and shipped-manifest layouts all keep it so."""

    def load(root: Path, index: Mapping[str, Any], options: Any) -> WanVAE:
        vae = load_wan_vae(root / subfolder, device=options.device, dtype=options.dtype).eval().requires_grad_(False)
        return deploy_fused(vae, options)

    return load


# The fused kernel a compiled CUDA deployment takes (None: eager). Measured on an H100, 480x832x81
# bf16, chunks of 5 latent frames as served (benchmarks/results/vae_decode_triton_h100.jsonl): the
# hand-written Triton pass 1.040 s, Inductor's 1.181 s, eager 1.279 s (one frame a chunk: 1.169 /
# 1.302 / 1.393); max |diff| vs eager one frame a chunk 0.057 / 0.059 in [-1, 1], the size of bf16's
# other reorderings (0.052 for eager chunks of 5). Triton compiles its kernel in ~2 s on first use
# (Inductor's pass ~19 s); vae_decode_fused_h100.jsonl has the first Inductor figures.
FUSED_ON_CUDA: FusedKernel | None = "triton"


def fused_for(options: Any) -> FusedKernel | None:
    """The fused norm -> SiLU -> padding kernel a deployment's VAE takes (:meth:`WanVAE.use_fused`),
    or None for the eager reference: ``FUSED_ON_CUDA`` with ``LoadOptions.compile`` on CUDA (compile
    on CUDA needs Triton, which both kernels use); a CPU keeps the eager reference."""
    if FUSED_ON_CUDA is None or not options.compile or torch.device(options.device).type != "cuda":
        return None
    return FUSED_ON_CUDA


def deploy_fused(vae: WanVAE, options: Any) -> WanVAE:
    """``vae`` with the fused pass :func:`fused_for` chooses for ``options`` (or eager)."""
    kernel = fused_for(options)
    return vae.use_fused(False) if kernel is None else vae.use_fused(True, kernel)


# -- one file in the original layout ------------------------------------------------------
#
# The Wan2.1 / Wan2.2 VAEs as one file in the original layout (``Wan2.1_VAE.pth`` converted to
# safetensors; ComfyUI's ``vae/wan_2.1_vae.safetensors``) -> :class:`WanVAE`.
#
# Original keys -> diffusers ``AutoencoderKLWan`` keys (then the diffusers -> ours renames of
# :mod:`wan_vae`):
#
# * ``{encoder,decoder}.conv1`` -> ``conv_in``; ``head.0.gamma`` / ``head.2`` -> ``norm_out`` /
#   ``conv_out``; ``conv1`` / ``conv2`` (top level) -> ``quant_conv`` / ``post_quant_conv``
# * ``middle.0`` / ``middle.2`` -> ``mid_block.resnets.0/1``; ``middle.1`` -> ``mid_block.attentions.0``
# * residual blocks: ``residual.0.gamma`` / ``residual.2`` / ``residual.3.gamma`` / ``residual.6``
#   / ``shortcut`` -> ``norm1.gamma`` / ``conv1`` / ``norm2.gamma`` / ``conv2`` / ``conv_shortcut``
# * ``encoder.downsamples.{i}`` -> ``encoder.down_blocks.{i}`` (one flat list in both)
# * ``decoder.upsamples.{i}``: a flat list of ``num_res_blocks + 1`` residual blocks then one
#   upsampler per level (none after the last) -> ``decoder.up_blocks.{level}.resnets.{j}`` /
#   ``.upsamplers.0``
#
# Wan2.2's VAE (``Wan2.2_VAE.pth``; ComfyUI's ``vae/wan2.2_vae.safetensors``) nests each level:
#
# * ``encoder.downsamples.{i}.downsamples.{j}`` -> ``encoder.down_blocks.{i}.resnets.{j}``, and its
#   last entry (a resample) -> ``encoder.down_blocks.{i}.downsampler``
# * ``decoder.upsamples.{i}.upsamples.{j}`` -> ``decoder.up_blocks.{i}.resnets.{j}``, its last entry
#   -> ``decoder.up_blocks.{i}.upsampler`` (diffusers' conversion script ``convert_vae_22``)
#
# The file has no config: the widths are read off the shapes; the level structure is
# Wan2.1's / Wan2.2's (``dim_mult (1, 2, 4, 4)``), the residual blocks per level and the
# temporal levels counted from the keys. The latent statistics are the released ones.
WAN_VAE_MARKER = "decoder.middle.0.residual.0.gamma"  # diffusers' detection key
_ORIGINAL_RESIDUAL = (("residual.0.gamma", "norm1.gamma"), ("residual.2.", "conv1."), ("residual.3.gamma", "norm2.gamma"),
             ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut."))
_ORIGINAL_FIXED = (
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.head\.0\.gamma$", r"\1.norm_out.gamma"),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
)


def _original_residual(rest: str) -> str:
    for a, b in _ORIGINAL_RESIDUAL:
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest  # resample.*, time_conv.*: same names


def _original_nested(key: str) -> str | None:
    """A Wan2.2 nested level key -> diffusers' (None: not one)."""
    m = re.match(r"^(encoder\.down|decoder\.up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.*)$", key)
    if m is None:
        return None
    side, level, j, rest = m[1], m[2], m[3], m[4]
    block = f"{side.replace('.down', '.down_blocks').replace('.up', '.up_blocks')}.{level}"
    if rest.startswith(("resample.", "time_conv.")):
        return f"{block}.{'downsampler' if side == 'encoder.down' else 'upsampler'}.{rest}"
    return f"{block}.resnets.{j}.{_original_residual(rest)}"


def vae_diffusers_key_from_original(key: str, num_res_blocks: int) -> str:
    nested = _original_nested(key)
    if nested is not None:
        return nested
    for pattern, repl in _ORIGINAL_FIXED:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    if m := re.match(r"^(encoder|decoder)\.middle\.([02])\.(.*)$", key):
        return f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_original_residual(m[3])}"
    if m := re.match(r"^encoder\.downsamples\.(\d+)\.(.*)$", key):
        return f"encoder.down_blocks.{m[1]}.{_original_residual(m[2])}"
    if m := re.match(r"^decoder\.upsamples\.(\d+)\.(.*)$", key):
        level, j = divmod(int(m[1]), num_res_blocks + 2)  # per level: resnets, then the upsampler
        if j <= num_res_blocks:
            return f"decoder.up_blocks.{level}.resnets.{j}.{_original_residual(m[2])}"
        return f"decoder.up_blocks.{level}.upsamplers.0.{m[2]}"
    return key


def wan_vae_config_from_original(shapes: dict[str, torch.Size]) -> WanVAEConfig:
    if WAN_VAE_MARKER not in shapes or "encoder.conv1.weight" not in shapes:
        raise ValueError(f"not an original-layout Wan VAE (no {WAN_VAE_MARKER}); pass the Wan2.1 VAE file "
                         "(wan_2.1_vae.safetensors)")
    base_dim, in_channels = shapes["encoder.conv1.weight"][:2]
    if in_channels == 12:
        return _wan22_config_from_original(shapes, base_dim)
    if in_channels != 3:
        raise ValueError(f"this VAE takes {in_channels} input channels; the Wan2.1 VAE takes 3, Wan2.2's "
                         "patchified one 12: pass wan_2.1_vae.safetensors or wan2.2_vae.safetensors")
    z_dim = shapes["conv2.weight"][0]
    if z_dim != len(WAN21_LATENTS_MEAN):
        raise ValueError(f"this VAE has {z_dim} latent channels; the Wan2.1 VAE file has 16 (its latent statistics "
                         "are not in the file, so only Wan2.1's load from a single file)")
    return WanVAEConfig(base_dim=base_dim, z_dim=z_dim)


def _wan22_config_from_original(shapes: dict[str, torch.Size], base_dim: int) -> WanVAEConfig:
    missing = [k for k in ("decoder.conv1.weight", "decoder.head.2.weight") if k not in shapes]
    if missing:
        raise ValueError(f"this Wan2.2-layout VAE file lacks {missing}; pass the whole wan2.2_vae.safetensors")
    z_dim = shapes["decoder.conv1.weight"][1]
    if z_dim != len(WAN22_LATENTS_MEAN):
        raise ValueError(f"this Wan2.2-layout VAE has {z_dim} latent channels; the Wan2.2 VAE file has 48 (its latent "
                         "statistics are not in the file, so only the released one loads from a single file)")
    dim_mult = (1, 2, 4, 4)
    levels = sorted({int(k.split(".")[2]) for k in shapes if k.startswith("encoder.downsamples.")})
    if levels != list(range(len(dim_mult))):
        raise ValueError(f"this Wan2.2-layout VAE has encoder levels {levels}; the Wan2.2 VAE has 4 "
                         "(dim_mult 1, 2, 4, 4): pass wan2.2_vae.safetensors")
    num_res_blocks = sum(1 for k in shapes if re.match(r"^encoder\.downsamples\.0\.downsamples\.\d+\.residual\.0\.gamma$", k))
    temporal = tuple(f"encoder.downsamples.{i}.downsamples.{num_res_blocks}.time_conv.weight" in shapes
                     for i in range(len(dim_mult) - 1))
    return WanVAEConfig(base_dim=base_dim, decoder_base_dim=shapes["decoder.head.2.weight"][1], z_dim=z_dim,
                        dim_mult=dim_mult, num_res_blocks=num_res_blocks, temperal_downsample=temporal,
                        is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                        latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)


def load_wan_vae_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.bfloat16) -> WanVAE:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the Wan2.1 or Wan2.2 VAE .safetensors file")
    raw = read_single_file(path, cast_to(device, dtype), sections=VAE_SECTIONS)
    config = wan_vae_config_from_original({k: t.shape for k, t in raw.items()})
    diffusers_sd = {vae_diffusers_key_from_original(k, config.num_res_blocks): raw.pop(k) for k in list(raw)}
    sd = vae_state_dict_from_diffusers(diffusers_sd)
    with torch.device("meta"):
        model = WanVAE(config)
    check_and_assign(model, sd, str(path), "pass the Wan2.1 or Wan2.2 VAE file (dim_mult 1,2,4,4)")
    return model.eval().requires_grad_(False)
