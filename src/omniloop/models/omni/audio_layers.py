"""The Whisper-style audio encoder layers of the omni families' thinkers (Qwen2.5-Omni's and
Qwen3-Omni's ``thinker.audio_tower.layers.*``, transformers' module names): pre-LN blocks whose
attention stays inside each window of packed frames (the ``cu_seqlens`` windows: bidirectional
within, nothing across), the sinusoidal position table they add to the conv front end's output,
and what both encoders read the same way before it: ``audio_config``'s shared fields and the mel
frames cut into padded chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
        self.length, self.channels = length, channels
        self.positional_embedding = nn.Buffer(sinusoid_table(length, channels), persistent=False)

    def rebuild(self, device: torch.device | str) -> None:
        """The table computed for real (a module built on ``meta`` has none)."""
        table = sinusoid_table(self.length, self.channels).to(device)
        self.register_buffer("positional_embedding", table, persistent=False)


class AudioEncoderModule(nn.Module):
    """The base of both families' audio encoders: whatever their front end, their positions come
    from a sinusoid table that is computed, never stored (``positional_embedding``)."""

    positional_embedding: SinusoidsPositionEmbedding

    def rebuild_buffers(self, device: torch.device | str) -> None:
        """The position table computed for real (a module built on ``meta`` has none)."""
        self.positional_embedding.rebuild(device)


@dataclass(frozen=True, kw_only=True)
class AudioTowerConfig:
    """What both encoders read of ``thinker_config.audio_config`` (each family's config adds its
    windows and front end)."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    output_dim: int
    max_source_positions: int

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio_config: d_model={self.d_model} must be a multiple of "
                             f"encoder_attention_heads={self.encoder_attention_heads}")

    @staticmethod
    def shared_fields(d: Mapping[str, Any]) -> dict[str, Any]:
        """``audio_config`` -> this class's fields; an unsupported activation is refused."""
        if d.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"audio_config: activation_function={d['activation_function']!r} is not supported; "
                             "expected 'gelu'")
        return dict(num_mel_bins=int(d.get("num_mel_bins", 128)), d_model=int(d.get("d_model", 1280)),
                    encoder_layers=int(d.get("encoder_layers", 32)),
                    encoder_attention_heads=int(d.get("encoder_attention_heads", 20)),
                    encoder_ffn_dim=int(d.get("encoder_ffn_dim", 5120)), output_dim=int(d.get("output_dim", 3584)),
                    max_source_positions=int(d.get("max_source_positions", 1500)))


def padded_chunks(features: torch.Tensor, lengths: Sequence[int], n_window: int) -> tuple[torch.Tensor, list[int]]:
    """``features [mel, sum(lengths)]`` -> chunks of ``2 * n_window`` frames right-padded to the
    longest ``[C, mel, F]``, and each chunk's real frame count (an audio's last chunk holds its remainder)."""
    size = 2 * n_window
    sizes = [min(size, n - start) for n in lengths for start in range(0, n, size)]
    chunks = features.T.split(sizes, dim=0)  # each [frames, mel]
    return nn.utils.rnn.pad_sequence(list(chunks), batch_first=True).transpose(1, 2), sizes
