"""Qwen2.5-Omni's vision encoder (``thinker.visual.*``): image/video patches -> one embedding per
``spatial_merge_size``^2 patches, in the thinker's hidden size.

transformers' ``Qwen2_5OmniVisionEncoder`` (the Qwen2.5-VL ViT), module for module:

1. ``patch_embed``: a Conv3d over ``temporal_patch_size x patch_size^2`` pixel patches
   (the image processor's flattened ``pixel_values [N, C * T * P * P]``);
2. the patches reordered window by window (windows of ``window_size`` pixels, in merged
   cells), with axial 2-D rotary angles (h, w) per patch;
3. ``depth`` blocks (RMSNorm, rotary attention, SwiGLU with biases); the blocks listed in
   ``fullatt_block_indexes`` attend over each frame, the others inside each window;
4. ``merger``: RMSNorm, 2x2 patches concatenated, MLP to ``out_hidden_size``; back to raster order.

The ``chat`` node runs it over a request's images (``chat_prompt.py``); the module holds no
request state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.omni.image_prompt import ImageInput
from omniloop.models.omni.video_prompt import VideoInput


@dataclass(frozen=True, kw_only=True)
class VisionEncoderConfig:
    """``thinker_config.vision_config`` of the checkpoint."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                             "multiple of 4 (the axial rotary splits the head in h and w halves)")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "VisionEncoderConfig":
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config: hidden_act={d['hidden_act']!r} is not supported; expected 'silu'")
        rope = d.get("rope_parameters") or {}
        return cls(depth=int(d.get("depth", 32)), hidden_size=int(d.get("hidden_size", 3584)),
                   intermediate_size=int(d.get("intermediate_size", 3420)), num_heads=int(d.get("num_heads", 16)),
                   in_channels=int(d.get("in_channels", 3)), patch_size=int(d.get("patch_size", 14)),
                   spatial_merge_size=int(d.get("spatial_merge_size", 2)),
                   temporal_patch_size=int(d.get("temporal_patch_size", 2)), window_size=int(d.get("window_size", 112)),
                   out_hidden_size=int(d.get("out_hidden_size", 3584)),
                   fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalize in fp32, scale in the model dtype (transformers' order)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 on ``x [N, H, D]`` with ``cos, sin [N, 1, D]`` (back to x's dtype)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos + torch.cat((-xf[..., half:], xf[..., :half]), dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.hidden_size // c.num_heads
        self.q = nn.Linear(c.hidden_size, c.hidden_size, bias=True)
        self.k = nn.Linear(c.hidden_size, c.hidden_size, bias=True)
        self.v = nn.Linear(c.hidden_size, c.hidden_size, bias=True)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.attention_backend = DEFAULT_BACKEND  # set from outside by set_attention_backend

    def forward(self, x: torch.Tensor, windows: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [N, d]`` -> ``[N, d]``, attention inside each run of ``windows`` patches."""
        n = x.shape[0]
        q = _rotate(self.q(x).view(n, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k(x).view(n, self.heads, self.head_dim), cos, sin)
        v = self.v(x).view(n, self.heads, self.head_dim)
        outs = [attention(qw[None], kw[None], vw[None], self.attention_backend)[0]  # [L, H, D]
                for qw, kw, vw in zip(q.split(list(windows)), k.split(list(windows)), v.split(list(windows)))]
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size)
        self.norm2 = RMSNorm(c.hidden_size)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, windows: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), windows, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.c = c
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        c = self.c
        x = pixels.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)  # [N, d]


class PatchMerger(nn.Module):
    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size**2
        self.ln_q = RMSNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, c.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


@dataclass(frozen=True)
class VisionLayout:
    """Where every patch of a batch of images / videos goes: rotary angles, window order and the
    attention runs (``frames``: per frame; ``windows``: per window), in window order."""

    angles: torch.Tensor  # [N, D / 2] (h then w angles), raster order
    window_index: torch.Tensor  # [N / merge^2] merged cells in window order
    frames: list[int]
    windows: list[int]


def vision_layout(c: VisionEncoderConfig, grid_thw: Sequence[tuple[int, int, int]], inv_freq: torch.Tensor) -> VisionLayout:
    """transformers' ``get_vision_position_ids`` / ``get_vision_window_index`` /
    ``get_vision_cu_seqlens`` for ``grid_thw`` (patches per axis of each image or video)."""
    m, unit = c.spatial_merge_size, c.spatial_merge_size**2
    cells = c.window_size // m // c.patch_size  # merged cells per window side
    positions, order, frames, windows, offset = [], [], [], [], 0
    for t, h, w in grid_thw:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // m, m, w // m, m)  # positions laid out block by block (merged cells)
        hw = torch.stack([hh.reshape(blocks).transpose(1, 2).flatten(), ww.reshape(blocks).transpose(1, 2).flatten()], -1)
        positions.append(hw.repeat(t, 1))
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = cells - gh % cells, cells - gw % cells
        padded = F.pad(index, (0, pw, 0, ph), "constant", -100)
        nh, nw = (gh + ph) // cells, (gw + pw) // cells
        padded = padded.reshape(t, nh, cells, nw, cells).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, cells, cells)
        sizes = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        windows += [int(s) * unit for s in sizes if s > 0]
        frames += [h * w] * t
        offset += t * gh * gw
    pos = torch.cat(positions).to(inv_freq.device)  # [N, 2]
    freqs = pos[..., None].float() * inv_freq.float()  # [N, 2, D / 4]
    return VisionLayout(angles=torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1), window_index=torch.cat(order),
                        frames=frames, windows=windows)


class OmniVisionEncoder(nn.Module):
    """transformers' ``Qwen2_5OmniVisionEncoder``: flattened patches -> merged embeddings."""

    def __init__(self, c: VisionEncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The axial rotary frequencies (``head_dim / 2`` spatial dims, every other one)."""
        dim = self.config.hidden_size // self.config.num_heads // 2
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))

    def _windowed(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """Rows of ``x [N, ...]`` regrouped merged cell by merged cell into window order."""
        unit = self.config.spatial_merge_size**2
        return x.reshape(x.shape[0] // unit, unit, -1)[window_index].reshape(x.shape[0], -1)

    def forward(self, pixels: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """``pixels [N, C * T * P * P]`` (the image processor's ``pixel_values``) of the images with
        ``grid_thw`` -> ``[N / merge^2, out_hidden_size]`` in raster order, image after image."""
        layout = vision_layout(self.config, grid_thw, self.inv_freq(pixels.device))
        # 1. patches in window order, with their rotary angles: [N, d], [N, 1, D]
        x = self._windowed(self.patch_embed(pixels), layout.window_index)
        angles = self._windowed(layout.angles, layout.window_index)
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        # 2. blocks: whole frames in the full-attention ones, windows elsewhere
        for i, block in enumerate(self.blocks):
            x = block(x, layout.frames if i in self.config.fullatt_block_indexes else layout.windows, cos, sin)
        # 3. merge 2x2 cells, back to raster order
        return self.merger(x)[torch.argsort(layout.window_index)]


def image_embeds(tower: OmniVisionEncoder, images: Sequence[ImageInput] | Sequence[VideoInput], device: torch.device,
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Each image's (or each video's) merged embeddings ``[tokens, D]`` (the tower run once over
    all of them: transformers' ``get_image_features`` / ``get_video_features``)."""
    merge = tower.config.spatial_merge_size
    out = tower(torch.cat([im.pixels for im in images]).to(device), [im.grid for im in images]).to(dtype)
    return list(out.split([im.tokens(merge) for im in images]))
