"""The Whisper-style audio encoder layers of the omni families' thinkers (Qwen2.5-Omni's and
Qwen3-Omni's ``thinker.audio_tower.layers.*``, transformers' module names): pre-LN blocks whose
attention stays inside each window of packed frames (the ``cu_seqlens`` windows: bidirectional
within, nothing across), and the sinusoidal position table they add to the conv front end's output."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention


def sinusoid_table(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """``[length, channels]``: sin then cos of ``position * timescale`` (Whisper's table)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


@dataclass(frozen=True)
class AudioLayerDims:
    """One encoder layer's shape (each family derives it from its ``audio_config``)."""

    d_model: int
    heads: int
    ffn: int
    k_bias: bool  # Qwen2.5-Omni's k_proj has no bias, Qwen3-Omni's has one


class AudioAttention(nn.Module):
    def __init__(self, c: AudioLayerDims) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.d_model // c.heads
        self.k_proj = nn.Linear(c.d_model, c.d_model, bias=c.k_bias)
        self.v_proj = nn.Linear(c.d_model, c.d_model, bias=True)
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=True)
        self.out_proj = nn.Linear(c.d_model, c.d_model, bias=True)
        self.attention_backend = DEFAULT_BACKEND  # set from outside by set_attention_backend

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        """``x [N, d]`` (every chunk's frames, packed) -> ``[N, d]``; attention runs inside each
        window of ``windows`` (frame counts summing to N), one backend call per window."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.heads, self.head_dim)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        outs = [attention(qw[None], kw[None], vw[None], self.attention_backend)[0]  # [L, H, D]
                for qw, kw, vw in zip(q.split(list(windows)), k.split(list(windows)), v.split(list(windows)))]
        return self.out_proj(torch.cat(outs).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, c: AudioLayerDims) -> None:
        super().__init__()
        self.self_attn = AudioAttention(c)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.ffn)
        self.fc2 = nn.Linear(c.ffn, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # transformers clamps fp16 activations here
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class SinusoidsPositionEmbedding(nn.Module):
    """The position table as a non-persistent buffer (not in the checkpoint; rebuilt at load)."""

    def __init__(self, length: int, channels: int) -> None:
        super().__init__()
        self.positional_embedding = nn.Buffer(sinusoid_table(length, channels), persistent=False)
