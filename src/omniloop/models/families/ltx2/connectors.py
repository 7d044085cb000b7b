"""LTX-2's text connectors (diffusers ``LTX2TextConnectors``), written natively.

Gemma's hidden states of every layer ``[B, L, D, layers]`` are normalized per prompt and
layer (masked mean / range; LTX-2.3: per-token RMS), projected to the caption width, and run
through two small 1-D transformers (one for the video stream, one for audio). Padding is
replaced by learnable registers: the real tokens are moved to the front and the rest of the
sequence is filled with the registers, so the DiT then attends to every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Mapping

import torch
from torch import nn

from omniloop.models.families.ltx2.model import FeedForward, LTX2Attention, rope_tables


@dataclass(frozen=True)
class LTX2ConnectorsConfig:
    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2ConnectorsConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def masked_mean_range_norm(hidden: torch.Tensor, lengths: torch.Tensor, padding_side: str, scale: int = 8,
                           eps: float = 1e-6) -> torch.Tensor:
    """[B, L, D, layers] -> [B, L, D * layers]: per prompt and layer, (x - mean) / (max - min)
    over the real tokens, times ``scale``; padding zeroed (diffusers ``per_layer_masked_mean_norm``)."""
    b, seq, dim, _ = hidden.shape
    dtype = hidden.dtype
    index = torch.arange(seq, device=hidden.device).unsqueeze(0)
    mask = index < lengths[:, None] if padding_side == "right" else index >= (seq - lengths[:, None])
    mask = mask[:, :, None, None]
    mean = hidden.masked_fill(~mask, 0.0).sum(dim=(1, 2), keepdim=True) / ((lengths * dim).view(b, 1, 1, 1) + eps)
    lo = hidden.masked_fill(~mask, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = hidden.masked_fill(~mask, float("-inf")).amax(dim=(1, 2), keepdim=True)
    out = ((hidden - mean) / (hi - lo + eps) * scale).flatten(2)
    out = out.masked_fill(~mask.squeeze(-1).expand(-1, -1, out.shape[-1]), 0.0)
    return out.to(dtype=dtype)


def per_token_rms(hidden: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return hidden * torch.rsqrt(torch.mean(hidden**2, dim=2, keepdim=True) + eps)


class ConnectorBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, rope_type: str, gated: bool) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn1 = LTX2Attention(dim, heads, head_dim, rope_type=rope_type, gated=gated)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ff = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), mask=mask, rope=rope)
        return x + self.ff(self.norm2(x))


class Connector(nn.Module):
    def __init__(self, heads: int, head_dim: int, layers: int, registers: int | None, base_seq_len: int, theta: float,
                 double_precision: bool, rope_type: str, gated: bool) -> None:
        super().__init__()
        self.dim, self.heads = heads * head_dim, heads
        self.base_seq_len, self.theta, self.double_precision, self.rope_type = base_seq_len, theta, double_precision, rope_type
        self.num_registers = registers
        self.learnable_registers = nn.Parameter(torch.empty(registers, self.dim)) if registers else None
        self.blocks = nn.ModuleList(ConnectorBlock(self.dim, heads, head_dim, rope_type, gated) for _ in range(layers))
        self.norm_out = nn.RMSNorm(self.dim, eps=1e-6, elementwise_affine=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, L, D], ``valid`` [B, L] bool -> (states, the positions attended inside)."""
        b, seq, _ = x.shape
        if self.learnable_registers is not None:
            assert self.num_registers, "learnable registers come with their count"
            if seq % self.num_registers:
                raise ValueError(f"the text length {seq} must be a multiple of the {self.num_registers} registers; "
                                 "set the tokenizer's model_max_length accordingly")
            registers = self.learnable_registers.unsqueeze(0).expand(seq // self.num_registers, -1, -1).reshape(seq, -1)
            keep = valid.int()
            order = torch.argsort(1 - keep, dim=1, stable=True)  # real tokens first, in order
            front = torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            front_mask = (torch.arange(seq, device=x.device).unsqueeze(0) < keep.sum(dim=1, keepdim=True)).unsqueeze(-1)
            x = torch.where(front_mask, front, registers.unsqueeze(0).expand(b, -1, -1).to(x.dtype))
            valid = torch.ones_like(valid)
        grid = (torch.arange(seq, dtype=torch.float32, device=x.device) / self.base_seq_len).unsqueeze(0).repeat(b, 1)
        rope = rope_tables(grid[..., None], self.dim, self.theta, self.double_precision, self.rope_type, self.heads)
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        for block in self.blocks:
            x = block(x, mask, rope)
        return self.norm_out(x), valid


class LTX2Connectors(nn.Module):
    def __init__(self, config: LTX2ConnectorsConfig) -> None:
        super().__init__()
        c = self.config = config
        width = c.caption_channels * c.text_proj_in_factor
        if c.per_modality_projections:
            self.video_text_proj_in = nn.Linear(width, c.video_hidden_dim, bias=c.proj_bias)
            self.audio_text_proj_in = nn.Linear(width, c.audio_hidden_dim, bias=c.proj_bias)
        else:
            self.text_proj_in = nn.Linear(width, c.caption_channels, bias=c.proj_bias)
        connector = partial(Connector, base_seq_len=c.connector_rope_base_seq_len, theta=c.rope_theta,
                            double_precision=c.rope_double_precision, rope_type=c.rope_type)
        self.video_connector = connector(c.video_connector_num_attention_heads, c.video_connector_attention_head_dim,
                                         c.video_connector_num_layers, c.video_connector_num_learnable_registers,
                                         gated=c.video_gated_attn)
        self.audio_connector = connector(c.audio_connector_num_attention_heads, c.audio_connector_attention_head_dim,
                                         c.audio_connector_num_layers, c.audio_connector_num_learnable_registers,
                                         gated=c.audio_gated_attn)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, padding_side: str = "left"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gemma states [B, L, D * layers] and the tokenizer mask [B, L] -> (video states, audio
        states, the mask the DiT's text cross-attention uses [B, L])."""
        c = self.config
        hidden = hidden.unflatten(2, (c.caption_channels, -1))  # [B, L, D, layers]
        if c.per_modality_projections:
            normed = per_token_rms(hidden).flatten(2, 3)
            normed = torch.where(mask.bool().unsqueeze(-1), normed, torch.zeros_like(normed))
            video = self.video_text_proj_in(normed * math.sqrt(c.video_hidden_dim / c.caption_channels))
            audio = self.audio_text_proj_in(normed * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:
            normed = masked_mean_range_norm(hidden, mask.sum(dim=-1), padding_side)
            video = audio = self.text_proj_in(normed)
        valid = mask.bool()
        video, _ = self.video_connector(video, valid)
        audio, _ = self.audio_connector(audio, valid)
        # NOTE: diffusers derives the DiT's text mask as (additive connector mask < 1e-6), which
        # holds at every position (the mask is 0 or -max): the DiT attends to all of them, the
        # padding's connector states included. Mirrored, so the same checkpoint gives the same video.
        attend = torch.ones_like(mask, dtype=torch.int64)
        return video * attend.unsqueeze(-1), audio, attend
