"""Stable Audio's DiT and its seconds-conditioning projection, written natively.

Same math as diffusers' ``StableAudioDiTModel`` and ``StableAudioProjectionModel`` (the
parity oracle in ``tests/models/stable_audio``): a pre-norm transformer over audio latent
frames with one global token (seconds + timestep) prepended, partial rotary embeddings on
self-attention (the first half of each head), grouped-query cross-attention to the T5 text
(+ seconds) tokens, SwiGLU feed-forwards, 1x1 conv residuals before and after.

Vocabulary: ``C`` latent channels, ``L`` latent frames (``sample_size``), ``D`` model width
(``heads * head_dim``), ``Lt`` text tokens + 2 seconds tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.run_blocks import BlockInterceptor, run_blocks


@dataclass(frozen=True)
class StableAudioDiTConfig:
    sample_size: int = 1024
    in_channels: int = 64
    num_layers: int = 24
    attention_head_dim: int = 64
    num_attention_heads: int = 24
    num_key_value_attention_heads: int = 12
    out_channels: int = 64
    cross_attention_dim: int = 768
    time_proj_dim: int = 256
    global_states_input_dim: int = 1536
    cross_attention_input_dim: int = 768

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        return self.attention_head_dim // 2  # the pipeline's rotary_embed_dim

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "StableAudioDiTConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def rotary_tables(dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, dim] (diffusers ``get_1d_rotary_pos_embed(use_real=True,
    repeat_interleave_real=False)``: each half repeats the dim/2 frequencies)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))  # [dim/2]
    freqs = torch.outer(torch.arange(length, device=device), freqs)  # [S, dim/2]
    return torch.cat([freqs.cos(), freqs.cos()], dim=-1).float(), torch.cat([freqs.sin(), freqs.sin()], dim=-1).float()


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head of ``x`` [B, H, S, Dh] in fp32
    (rotate-half pairing, diffusers' ``use_real_unbind_dim=-2``); the rest pass through."""
    rot = cos.shape[-1]
    dtype = x.dtype
    x = x.float()
    head, tail = x[..., :rot], x[..., rot:]
    real, imag = head.reshape(*head.shape[:-1], 2, -1).unbind(-2)
    rotated = torch.cat([-imag, real], dim=-1)
    out = (head.float() * cos + rotated.float() * sin).to(head.dtype)
    return torch.cat((out, tail), dim=-1).to(dtype)


class Attention(nn.Module):
    """Multi-head attention without biases; ``kv_heads < heads`` is grouped-query."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None = None, kv_heads: int | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.kv_heads = kv_heads or heads
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(kv_dim or dim, self.kv_heads * head_dim, bias=False)
        self.to_v = nn.Linear(kv_dim or dim, self.kv_heads * head_dim, bias=False)
        self.to_out = nn.Linear(heads * head_dim, dim, bias=False)
        self.attention_backend: str = DEFAULT_BACKEND

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b = x.shape[0]
        ctx = x if context is None else context
        q = self.to_q(x).view(b, -1, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, Dh]
        k = self.to_k(ctx).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.to_v(ctx).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:  # as diffusers: repeat the kv heads before attention
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if rope is not None:  # self-attention only: both q and k rotate
            q, k = apply_partial_rotary(q, *rope), apply_partial_rotary(k, *rope)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=self.attention_backend)
        return self.to_out(out.reshape(b, -1, self.heads * self.head_dim).to(q.dtype))


class SwiGLUFeedForward(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, 2 * inner)  # [hidden | gate]
        self.proj_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(hidden * F.silu(gate))


class StableAudioBlock(nn.Module):
    def __init__(self, config: StableAudioDiTConfig) -> None:
        super().__init__()
        d, h, dh = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.self_attn = Attention(d, h, dh)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.cross_attn = Attention(d, h, dh, kv_dim=config.cross_attention_dim,
                                    kv_heads=config.num_key_value_attention_heads)
        self.norm3 = nn.LayerNorm(d, eps=1e-5)
        self.ff = SwiGLUFeedForward(d, 4 * d)

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), rope=(cos, sin))
        x = x + self.cross_attn(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


def _mlp(in_dim: int, dim: int, bias: bool) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, dim, bias=bias), nn.SiLU(), nn.Linear(dim, dim, bias=bias))


class StableAudioDiT(nn.Module):
    def __init__(self, config: StableAudioDiTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.inner_dim
        # Gaussian Fourier features of the timestep (fixed random frequencies from the checkpoint)
        self.time_freqs = nn.Parameter(torch.empty(config.time_proj_dim // 2), requires_grad=False)
        self.timestep_proj = _mlp(config.time_proj_dim, d, bias=True)
        self.global_proj = _mlp(config.global_states_input_dim, d, bias=False)
        self.cross_attention_proj = _mlp(config.cross_attention_input_dim, config.cross_attention_dim, bias=False)
        self.preprocess_conv = nn.Conv1d(config.in_channels, config.in_channels, 1, bias=False)
        self.proj_in = nn.Linear(config.in_channels, d, bias=False)
        self.blocks = nn.ModuleList(StableAudioBlock(config) for _ in range(config.num_layers))
        self.proj_out = nn.Linear(d, config.out_channels, bias=False)
        self.postprocess_conv = nn.Conv1d(config.out_channels, config.out_channels, 1, bias=False)
        self._rope: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # constant tables

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    def time_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, time_proj_dim]: cos ++ sin of 2 pi t w (diffusers' flip_sin_to_cos)."""
        t = timestep.to(self.dtype)
        proj = 2 * math.pi * t[:, None] @ self.time_freqs[None, :]
        return torch.cat([torch.cos(proj), torch.sin(proj)], dim=-1)

    def rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, device)
        if key not in self._rope:  # deployment-wide constant per length, never per request
            self._rope[key] = rotary_tables(self.config.rotary_dim, length, device)
        return self._rope[key]

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, C, L]
        timestep: torch.Tensor,  # [B] (atan-preconditioned sigma)
        encoder_hidden_states: torch.Tensor,  # [B, Lt, cross_attention_input_dim]
        global_hidden_states: torch.Tensor,  # [B, 1, global_states_input_dim]
        block_interceptor: BlockInterceptor | None = None,
    ) -> torch.Tensor:
        # 1. Conditioning: text tokens, and one global token = seconds + timestep
        context = self.cross_attention_proj(encoder_hidden_states)
        time = self.timestep_proj(self.time_embedding(timestep))  # [B, D]
        global_token = self.global_proj(global_hidden_states) + time.unsqueeze(1)  # [B, 1, D]
        # 2. Latent frames in, global token first
        x = self.preprocess_conv(hidden_states) + hidden_states
        x = torch.cat([global_token, self.proj_in(x.transpose(1, 2))], dim=-2)  # [B, 1 + L, D]
        cos, sin = self.rope(x.shape[1], x.device)
        # 3. Blocks
        x = run_blocks(self.blocks, x, context, cos, sin, interceptor=block_interceptor)
        # 4. Out, without the global token
        x = self.proj_out(x).transpose(1, 2)[:, :, 1:]  # [B, C_out, L]
        return self.postprocess_conv(x) + x


# -- the seconds conditioning (StableAudioProjectionModel) ---------------------------------


@dataclass(frozen=True)
class StableAudioProjectionConfig:
    text_encoder_dim: int
    conditioning_dim: int
    min_value: int
    max_value: int

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "StableAudioProjectionConfig":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


class NumberConditioner(nn.Module):
    """A number in [min, max] -> one [1, D] token: normalized, Fourier features with
    learned frequencies (plus the value itself), a linear layer."""

    def __init__(self, dim: int, min_value: float, max_value: float, internal_dim: int = 256) -> None:
        super().__init__()
        self.min_value, self.max_value = min_value, max_value
        self.freqs = nn.Parameter(torch.empty(internal_dim // 2), requires_grad=False)
        self.proj = nn.Linear(internal_dim + 1, dim)

    def forward(self, values: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1, D]
        values = values.clamp(self.min_value, self.max_value)
        t = ((values - self.min_value) / (self.max_value - self.min_value)).to(self.proj.weight.dtype)[..., None]
        f = t * self.freqs[None] * 2 * math.pi
        features = torch.cat((t, torch.cat((f.sin(), f.cos()), dim=-1)), dim=-1)
        return self.proj(features).view(-1, 1, self.proj.out_features)


class StableAudioProjection(nn.Module):
    """T5 states -> the DiT's conditioning width, and the start/end seconds tokens."""

    def __init__(self, config: StableAudioProjectionConfig) -> None:
        super().__init__()
        self.config = config
        same = config.text_encoder_dim == config.conditioning_dim
        self.text_projection = nn.Identity() if same else nn.Linear(config.text_encoder_dim, config.conditioning_dim)
        self.start = NumberConditioner(config.conditioning_dim, config.min_value, config.max_value)
        self.end = NumberConditioner(config.conditioning_dim, config.min_value, config.max_value)

    def project_text(self, states: torch.Tensor) -> torch.Tensor:
        return self.text_projection(states)

    def seconds(self, start_s: torch.Tensor, end_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] start and end seconds (float32) -> two [B, 1, conditioning_dim] tokens."""
        return self.start(start_s), self.end(end_s)
