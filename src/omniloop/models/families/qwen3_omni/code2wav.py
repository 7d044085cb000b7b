"""Qwen3-Omni's code2wav: the causal codec decoder from speech frames (``num_quantizers`` codes
each, 12.5 frames/s) to a 24 kHz waveform (transformers' ``Qwen3OmniMoeCode2Wav``).

codes ``[B, Q, T]`` -> the mean of the Q codebook embeddings ``[B, T, D]`` -> a pre-transformer
(8 layers of sliding-window causal attention + SwiGLU, layer-scaled residuals) -> upsampling
(causal transposed conv + ConvNeXt block per ratio) -> a causal conv decoder (SnakeBeta, causal
transposed convs, dilated residual units) -> ``[B, 1, T * total_upsample]`` clamped to [-1, 1].

Everything is causal (left-padded convolutions, transposed convolutions trimmed, causal
attention within a window), so a chunk decoded with enough left context equals the whole
decode's samples; transformers' own ``chunked_decode`` (300 frames, 25 of left context) is
what ``generate`` runs, and what :func:`chunked_decode` runs. Module names are transformers'
(``code2wav.pre_transformer.layers.0.self_attn.q_proj``, ``code2wav.upsample.0.1.dwconv.conv``...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.mrope import inv_frequencies
from omniloop.models.layers.qwen2_decoder import MLP, DecoderDims, RMSNorm, apply_rope, rope_tables
from omniloop.models.layers.snake import SnakeBeta

SAMPLE_RATE = 24000


@dataclass(frozen=True, kw_only=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int

    @property
    def total_upsample(self) -> int:
        """Waveform samples per frame (1920 for the released model: 80 ms at 24 kHz)."""
        return math.prod(self.upsample_rates + self.upsampling_ratios)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "Code2WavConfig":
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3-Omni code2wav: hidden_act={d['hidden_act']!r} is not supported; expected 'silu'")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        heads = int(d.get("num_attention_heads", 16))
        hidden = int(d.get("hidden_size", 1024))
        return cls(
            codebook_size=int(d.get("codebook_size", 2048)), num_quantizers=int(d.get("num_quantizers", 16)),
            hidden_size=hidden, intermediate_size=int(d.get("intermediate_size", 3072)),
            num_hidden_layers=int(d.get("num_hidden_layers", 8)), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(d.get("head_dim") or hidden // heads),
            sliding_window=int(d.get("sliding_window", 72)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            upsample_rates=tuple(int(r) for r in d.get("upsample_rates", (8, 5, 4, 3))),
            upsampling_ratios=tuple(int(r) for r in d.get("upsampling_ratios", (2, 2))),
            decoder_dim=int(d.get("decoder_dim", 1536)),
        )


# -- causal convolutions ------------------------------------------------------------------------


class CausalConv(nn.Module):
    """``conv`` left-padded by its receptive field less its stride (and right-padded to whole frames)."""

    def __init__(self, cin: int, cout: int, kernel: int, *, dilation: int = 1, stride: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.padding = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.span + self.padding) / self.stride + 1
        extra = (math.ceil(frames) - 1) * self.stride + (self.span - self.padding) - length
        return self.conv(F.pad(x, (self.padding, extra))).contiguous()


class CausalTransConv(nn.Module):
    """``ConvTranspose1d`` with ``kernel - stride`` samples trimmed from each end."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim:y.shape[-1] - self.trim].contiguous()


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 2, 1)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta -> causal transposed conv (x ``rate``, half the channels) -> residual units (dilations 1, 3, 9)."""

    def __init__(self, cin: int, rate: int) -> None:
        super().__init__()
        cout = cin // 2
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# -- the pre-transformer ------------------------------------------------------------------------


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class WindowAttention(nn.Module):
    def __init__(self, c: Code2WavConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.attention_backend = DEFAULT_BACKEND

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, n, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        out = attention(q, k, v, self.attention_backend, mask=mask)
        return self.o_proj(out.reshape(b, n, self.heads * self.head_dim))


class TransformerLayer(nn.Module):
    def __init__(self, c: Code2WavConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = WindowAttention(c)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(DecoderDims(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=1,
                                   num_kv_heads=1, head_dim=1, rms_norm_eps=c.rms_norm_eps, fused=False))
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, c: Code2WavConfig) -> None:
        super().__init__()
        self.config = c
        self.layers = nn.ModuleList(TransformerLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [B, T, D]`` -> ``[B, T, D]``: causal attention over the last ``sliding_window`` frames."""
        c, n = self.config, h.shape[1]
        pos = torch.arange(n, device=h.device)
        cos, sin = rope_tables((pos[:, None].float() * inv_frequencies(c.head_dim, c.rope_theta, h.device))[None], h.dtype)
        diff = pos[:, None] - pos[None, :]  # query - key
        mask = ((diff >= 0) & (diff < c.sliding_window))[None, None]  # [1, 1, T, T] True = attend
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class Code2Wav(nn.Module):
    def __init__(self, c: Code2WavConfig) -> None:
        super().__init__()
        self.config = c
        self.pre_transformer = PreTransformer(c)
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(c.hidden_size, c.hidden_size, r, r), ConvNeXtBlock(c.hidden_size)])
            for r in c.upsampling_ratios)
        blocks: list[nn.Module] = [CausalConv(c.hidden_size, c.decoder_dim, 7)]
        blocks += [DecoderBlock(c.decoder_dim // 2 ** i, rate) for i, rate in enumerate(c.upsample_rates)]
        out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
        blocks += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(blocks)

    @property
    def dtype(self) -> torch.dtype:
        return self.code_embedding.weight.dtype

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, Q, T]`` -> waveform ``[B, 1, T * total_upsample]`` in [-1, 1]."""
        c = self.config
        assert codes.shape[1] == c.num_quantizers, f"expected {c.num_quantizers} codebooks, got {codes.shape[1]}"
        offset = torch.arange(c.num_quantizers, device=codes.device)[None, :, None] * c.codebook_size
        h = self.pre_transformer(self.code_embedding(codes + offset).mean(1)).permute(0, 2, 1)  # [B, D, T]
        for stage in self.upsample:
            for layer in cast(nn.ModuleList, stage):
                h = layer(h)
        for layer in self.decoder:
            h = layer(h)
        return h.clamp(min=-1, max=1)


@dataclass(frozen=True)
class Window:
    """One call of transformers' ``chunked_decode``: frames ``start - context .. end`` decoded,
    the first ``context`` frames' samples dropped (left context for the causal layers)."""

    start: int
    end: int
    context: int

    @property
    def frames(self) -> int:
        return self.end - self.start + self.context


def windows(total: int, chunk: int, left_context: int, start: int = 0) -> list[Window]:
    """``chunked_decode``'s windows over frames ``start .. total``: ``chunk`` frames each, with
    ``left_context`` frames before them (fewer at the start: transformers takes the frames there are
    only while ``start - left_context > 0``, else all of them)."""
    out = []
    while start < total:
        end = min(start + chunk, total)
        out.append(Window(start, end, left_context if start - left_context > 0 else start))
        start = end
    return out


def decode_windows(model: Code2Wav, codes: Sequence[torch.Tensor], wins: Sequence[Window],
                   max_batch: int = 8) -> list[torch.Tensor]:
    """Windows of any requests' frames in few forwards: ``codes[i] [Q, T_i]`` and its window
    ``wins[i]`` -> the window's samples ``[1, (end - start) * total_upsample]``. Windows of one
    length run as one batch (up to ``max_batch`` rows a forward: the decoder's activations are
    ``rows * frames * total_upsample`` samples wide), so nothing is padded: each row sees its own
    frames only (every layer is per row: causal convolutions, attention within the row's window)."""
    hop = model.config.total_upsample
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(wins):
        groups.setdefault(w.frames, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(wins)
    for rows in groups.values():
        for k in range(0, len(rows), max_batch):
            part = rows[k:k + max_batch]
            batch = torch.stack([codes[i][:, wins[i].start - wins[i].context:wins[i].end] for i in part])  # [G, Q, n]
            wav = model(batch)  # [G, 1, n * hop]
            for row, i in enumerate(part):
                out[i] = wav[row, :, wins[i].context * hop:]
    return [w for w in out if w is not None]


def chunked_decode(model: Code2Wav, codes: torch.Tensor, chunk: int = 300, left_context: int = 25,
                   max_batch: int = 1) -> torch.Tensor:
    """transformers' ``Qwen3OmniMoeCode2Wav.chunked_decode``: ``codes [B, Q, T]`` decoded ``chunk``
    frames at a time, each with up to ``left_context`` frames before it whose samples are dropped
    -> ``[B, 1, samples]``. ``max_batch`` > 1: windows of one length (all the full ones past the
    first) decode as one batch (:func:`decode_windows`)."""
    wins = windows(codes.shape[-1], chunk, left_context)
    rows = [torch.cat(decode_windows(model, [c] * len(wins), wins, max_batch), dim=-1) for c in codes]  # each [1, samples]
    return torch.stack(rows)
