"""The toy networks: a two-block video DiT and a byte-level text encoder.

Small but real. The DiT patchifies each latent frame into 2x2 tokens, adds position features
of (frame, row, column), and runs ``ToyBlock``s (adaLN-modulated self-attention over every
token of the clip, cross-attention to the prompt, an MLP) through ``run_blocks``, so block
interceptors (the cache plugins) apply to it. Attention goes through the backend registry
(``attention_backend`` is set from outside by ``apply_load_options``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.run_blocks import BlockInterceptor, run_blocks
from omniloop.models.text.base import EncodedText

FREQ_DIM = 16  # sinusoid features per position axis and for the timestep


@dataclass(frozen=True)
class ToyDiTConfig:
    latent_channels: int = 4
    patch_size: int = 2
    dim: int = 32
    heads: int = 2
    layers: int = 2
    text_dim: int = 16
    ffn_dim: int = 64

    def __post_init__(self) -> None:
        assert self.dim % self.heads == 0, f"dim {self.dim} must split into {self.heads} heads"


@dataclass(frozen=True)
class ToyTextConfig:
    dim: int = 16
    max_sequence_length: int = 16


def sinusoid(positions: torch.Tensor, dim: int = FREQ_DIM) -> torch.Tensor:
    """[N] float positions -> [N, dim] (cos ++ sin of geometric frequencies)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=positions.device) / (dim // 2))
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class ToyAttention(nn.Module):
    """Multi-head attention: queries from ``x``, keys/values from ``source`` (itself: self-attention)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.attention_backend = DEFAULT_BACKEND

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        b, lq, d = x.shape
        q = self.to_q(x).view(b, lq, self.heads, d // self.heads)  # [B, Lq, H, Dh]
        k = self.to_k(source).view(b, source.shape[1], self.heads, d // self.heads)  # [B, Lk, H, Dh]
        v = self.to_v(source).view(b, source.shape[1], self.heads, d // self.heads)
        return self.to_out(attention(q, k, v, self.attention_backend).reshape(b, lq, d))


class ToyBlock(nn.Module):
    def __init__(self, config: ToyDiTConfig) -> None:
        super().__init__()
        d = config.dim
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.self_attn = ToyAttention(d, config.heads)
        self.norm2 = nn.LayerNorm(d)
        self.cross_attn = ToyAttention(d, config.heads)
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, config.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(config.ffn_dim, d))

    def forward(self, x: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor) -> torch.Tensor:
        """x [B, N, D], context [B, L, D], modulation [B, 6, D] -> [B, N, D]."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (m[:, None] for m in modulation.unbind(1))  # each [B, 1, D]
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.self_attn(h, h)
        x = x + self.cross_attn(self.norm2(x), context)
        return x + gate2 * self.mlp(self.norm3(x) * (1 + scale2) + shift2)


class ToyDiT(nn.Module):
    """latents [B, C, F, h, w] (h, w multiples of the patch), timestep [B] in [0, 1000),
    prompt embeddings [B, L, text_dim] -> the flow prediction [B, C, F, h, w]."""

    def __init__(self, config: ToyDiTConfig) -> None:
        super().__init__()
        self.config = config
        d, p, c = config.dim, config.patch_size, config.latent_channels
        self.patch_embed = nn.Linear(c * p * p, d)
        self.pos_embed = nn.Linear(3 * FREQ_DIM, d)
        self.time_embed = nn.Sequential(nn.Linear(FREQ_DIM, d), nn.SiLU(), nn.Linear(d, d))
        self.modulation = nn.Linear(d, 6 * d)
        self.text_proj = nn.Linear(config.text_dim, d)
        self.blocks = nn.ModuleList(ToyBlock(config) for _ in range(config.layers))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.out_modulation = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, c * p * p)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                block_interceptor: BlockInterceptor | None = None) -> torch.Tensor:
        b, c, f, h, w = latents.shape
        p, d = self.config.patch_size, self.config.dim
        hp, wp = h // p, w // p
        # 1. patchify: [B, C, F, h, w] -> [B, N = F * hp * wp, C * p * p]
        tokens = latents.reshape(b, c, f, hp, p, wp, p).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, f * hp * wp, c * p * p)
        x = self.patch_embed(tokens.to(self.patch_embed.weight.dtype)) + self.pos_embed(
            self._positions(f, hp, wp, latents.device).to(self.patch_embed.weight.dtype))  # [B, N, D]
        # 2. timestep -> embedding [B, D] -> the blocks' modulation [B, 6, D]
        temb = self.time_embed(sinusoid(timestep.reshape(-1).expand(b)).to(x.dtype))
        modulation = self.modulation(F.silu(temb)).view(b, 6, d)
        context = self.text_proj(encoder_hidden_states.to(x.dtype))  # [B, L, D]
        # 3. the block stack (interceptors may skip or replay it)
        x = run_blocks(self.blocks, x, context, modulation, interceptor=block_interceptor)
        # 4. output head and unpatchify
        shift, scale = self.out_modulation(F.silu(temb))[:, None].chunk(2, dim=-1)
        out = self.proj_out(self.norm_out(x) * (1 + scale) + shift)  # [B, N, C * p * p]
        return out.reshape(b, f, hp, wp, c, p, p).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)

    @staticmethod
    def _positions(f: int, hp: int, wp: int, device: torch.device) -> torch.Tensor:
        """[F * hp * wp, 3 * FREQ_DIM]: sinusoids of each token's (frame, row, column)."""
        grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(hp), torch.arange(wp), indexing="ij"), dim=-1)
        grid = grid.reshape(-1, 3).to(device)
        return torch.cat([sinusoid(grid[:, i]) for i in range(3)], dim=-1)


class ToyTextEncoder(nn.Module):
    """Byte-level: a prompt's UTF-8 bytes (+1; 0 pads) -> embeddings, one linear mix, a norm;
    positions past the prompt are zero (the ``TextEncoder`` contract of ``models/text``)."""

    def __init__(self, config: ToyTextConfig) -> None:
        super().__init__()
        self.config = config
        self.max_sequence_length = config.max_sequence_length
        self.hidden_size = config.dim
        self.embed = nn.Embedding(257, config.dim)
        self.mix = nn.Linear(config.dim, config.dim)
        self.norm = nn.LayerNorm(config.dim)

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """[B, max_sequence_length] int64 byte ids (truncated, zero-padded)."""
        ids = torch.zeros(len(prompts), self.max_sequence_length, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            data = list(prompt.encode("utf-8"))[: self.max_sequence_length]
            ids[i, : len(data)] = torch.tensor(data, dtype=torch.long) + 1
        return ids

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        param = self.embed.weight
        ids = self.tokenize(prompts).to(param.device)
        hidden = self.norm(self.embed(ids) + self.mix(self.embed(ids)))  # [B, L, D]
        mask = ids.gt(0)
        hidden = hidden * mask[..., None].to(hidden.dtype)
        return EncodedText(embeds=hidden.to(device or param.device), lengths=mask.sum(dim=1).tolist())
