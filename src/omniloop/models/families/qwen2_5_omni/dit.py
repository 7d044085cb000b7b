"""Token2wav's flow model: a DiT that predicts the mel-spectrogram velocity from codec codes,
a speaker embedding and a reference mel (transformers' ``Qwen2_5OmniToken2WavDiTModel``).

Module names are transformers' (``code2wav_dit_model.transformer_blocks.0.attn.to_q``...).
The ODE solver is not here: it is the ``rk4_flow`` sampler of the denoise loop; this module
is one velocity evaluation, with classifier-free guidance folded in as transformers' ``sample``
does (conditional and unconditional rows in one forward, ``g + (g - u) * scale``).

Numerics kept from the reference: the speaker encoder (ECAPA-TDNN) with reflect padding,
RoPE on the first attention head only, de-interleaved (the checkpoint was trained so), the
block-diagonal attention window per layer (``look_backward_layers`` / ``look_ahead_layers``
blocks of ``block_size`` frames), sinusoidal time embedding at scale 1000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    ff_mult: int
    emb_dim: int
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    look_ahead_layers: tuple[int, ...]
    look_backward_layers: tuple[int, ...]
    repeats: int
    num_embeds: int
    mel_dim: int
    enc_emb_dim: int
    enc_dim: int
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "DiTConfig":
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"token2wav dit_config rope_type={rope.get('rope_type')!r} is not supported")
        tup = lambda k: tuple(int(v) for v in d[k])  # noqa: E731
        out = cls(
            hidden_size=int(d["hidden_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]), head_dim=int(d["head_dim"]), ff_mult=int(d["ff_mult"]),
            emb_dim=int(d["emb_dim"]), rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=int(d["max_position_embeddings"]), block_size=int(d["block_size"]),
            look_ahead_layers=tup("look_ahead_layers"), look_backward_layers=tup("look_backward_layers"),
            repeats=int(d["repeats"]), num_embeds=int(d["num_embeds"]), mel_dim=int(d["mel_dim"]),
            enc_emb_dim=int(d["enc_emb_dim"]), enc_dim=int(d["enc_dim"]), enc_channels=tup("enc_channels"),
            enc_kernel_sizes=tup("enc_kernel_sizes"), enc_dilations=tup("enc_dilations"),
            enc_attention_channels=int(d["enc_attention_channels"]), enc_res2net_scale=int(d["enc_res2net_scale"]),
            enc_se_channels=int(d["enc_se_channels"]),
        )
        if not len(out.enc_channels) == len(out.enc_kernel_sizes) == len(out.enc_dilations):
            raise ValueError("token2wav dit_config: enc_channels, enc_kernel_sizes and enc_dilations must have one "
                             "entry per speaker-encoder layer")
        return out


# -- the speaker encoder (ECAPA-TDNN) -------------------------------------------------------


def _conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(cin // scale, cout // scale, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 0:
                out = part
            elif i == 1:
                out = self.blocks[i - 1](part)
            else:
                out = self.blocks[i - 1](part + out)
            outs.append(out)
        return torch.cat(outs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, cin: int, se: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(cin, se, 1), _conv(se, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, cout, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(cout, cout, 1, 1)
        self.se_block = SqueezeExcitationBlock(cout, se, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatisticsPooling(nn.Module):
    """Attention-weighted mean and std over time: ``[B, C, T]`` -> ``[B, 2C, 1]``."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def _stats(self, x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (m * x).sum(2)
        std = torch.sqrt((m * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(self.eps))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        mask = torch.ones(x.shape[0], 1, t, dtype=x.dtype, device=x.device)  # every frame is real
        mean, std = self._stats(x, mask / mask.sum(dim=2, keepdim=True))
        attn = torch.cat([x, mean.unsqueeze(2).repeat(1, 1, t), std.unsqueeze(2).repeat(1, 1, t)], dim=1)
        attn = F.softmax(self.conv(torch.tanh(self.tdnn(attn))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class ECAPA_TimeDelayNet(nn.Module):  # noqa: N801 (transformers' name: the checkpoint's keys)
    """Reference mel ``[B, T, mel]`` -> speaker vector ``[B, enc_dim]``."""

    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        ch = c.enc_channels
        blocks: list[nn.Module] = [TimeDelayNetBlock(c.mel_dim, ch[0], c.enc_kernel_sizes[0], c.enc_dilations[0])]
        blocks += [SqueezeExcitationRes2NetBlock(ch[i - 1], ch[i], c.enc_res2net_scale, c.enc_se_channels,
                                                 c.enc_kernel_sizes[i], c.enc_dilations[i]) for i in range(1, len(ch) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], c.enc_kernel_sizes[-1], c.enc_dilations[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], c.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, c.enc_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        outs = []
        for layer in self.blocks:
            x = layer(x)
            outs.append(x)
        x = self.asp(self.mfa(torch.cat(outs[1:], dim=1)))
        return self.fc(x).squeeze(-1)


# -- the DiT -----------------------------------------------------------------------------------


class DiTInputEmbedding(nn.Module):
    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(c.mel_dim + c.enc_dim + c.enc_emb_dim + c.emb_dim, c.hidden_size)
        self.spk_encoder = ECAPA_TimeDelayNet(c)

    def forward(self, x: torch.Tensor, speaker: torch.Tensor, voice: torch.Tensor, code_embed: torch.Tensor) -> torch.Tensor:
        """``voice [B, enc_dim]``: ``spk_encoder`` of each row's reference mel (``Token2WavDiT.voice_rows``)."""
        cond = voice.unsqueeze(1).repeat(1, x.size(1), 1)  # [B, T, enc_dim]
        return self.proj(torch.cat((x, cond, code_embed, speaker), dim=-1))


class DiTCodecEmbedding(nn.Module):
    def __init__(self, num_embeds: int, dim: int, repeats: int) -> None:
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num_embeds + 1, dim)

    def forward(self, code: torch.Tensor, drop_code: bool = False) -> torch.Tensor:
        if drop_code:
            code = torch.zeros_like(code)
        return torch.repeat_interleave(self.codec_embed(code), repeats=self.repeats, dim=1)  # [B, T*repeats, emb]


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.chunks = chunks

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.chunk(self.linear(F.silu(t)), self.chunks, dim=1)


def _per_row(mods: tuple[torch.Tensor, ...], rows: int) -> tuple[torch.Tensor, ...]:
    """Time modulations ``[G, D]`` each repeated for its ``rows / G`` rows (``G == rows``: as given).
    NOTE: windows of several requests at one ODE time share their time rows; computing them on
    ``G`` rows and repeating them, rather than on every row, keeps each window's numbers those of
    its solo run (a CPU GEMM of 2 rows rounds otherwise than one of 16)."""
    n = rows // mods[0].shape[0]
    assert n * mods[0].shape[0] == rows, f"{mods[0].shape[0]} time rows do not divide {rows} rows"
    return mods if n == 1 else tuple(m.repeat_interleave(n, dim=0) for m in mods)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DiTAttention(nn.Module):
    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        inner = c.head_dim * c.num_attention_heads
        self.heads = c.num_attention_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(c.hidden_size, inner) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, c.hidden_size)])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = (p(x).view(b, -1, self.heads, p.out_features // self.heads).transpose(1, 2)
                   for p in (self.to_q, self.to_k, self.to_v))  # [B, H, T, D]
        # NOTE: RoPE on the first head only, de-interleaved (how the checkpoint was trained)
        q[:, :1] = _rotate(_deinterleave(q[:, :1]), cos, sin)
        k[:, :1] = _rotate(_deinterleave(k[:, :1]), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        return self.to_out[0](out.transpose(1, 2).reshape(b, -1, self.heads * q.shape[-1]))


class DiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.ff = nn.ModuleList([nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"), nn.Dropout(0.0),
                                 nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class DiTDecoderLayer(nn.Module):
    def __init__(self, c: DiTConfig, look_ahead: int, look_backward: int) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(c.hidden_size, 6)
        self.attn = DiTAttention(c)
        self.ff = DiTMLP(c.hidden_size, c.ff_mult)
        self.look_ahead, self.look_backward = look_ahead, look_backward

    def forward(self, x: torch.Tensor, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                block_diff: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]``; ``t [G, D]`` time rows, each modulating ``B / G`` consecutive rows of ``x``."""
        mods = _per_row(self.attn_norm(t), x.shape[0])
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        norm = _layer_norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        mask = (block_diff >= -float(self.look_backward)) & (block_diff <= float(self.look_ahead))
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, cos, sin, mask)
        norm = _layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


class DiTTimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        emb = 1000 * t.unsqueeze(1) * freqs.unsqueeze(0)
        h = torch.cat((emb.sin(), emb.cos()), dim=-1).type_as(t)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class Token2WavDiT(nn.Module):
    """One guided velocity evaluation: ``x [B, T, mel]`` at time ``t`` -> ``[B, T, mel]``."""

    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.config = c
        self.time_embed = DiTTimestepEmbedding(c.hidden_size)
        self.text_embed = DiTCodecEmbedding(c.num_embeds, c.emb_dim, c.repeats)
        self.input_embed = DiTInputEmbedding(c)
        self.transformer_blocks = nn.ModuleList(
            DiTDecoderLayer(c, 1 if i in c.look_ahead_layers else 0, 1 if i in c.look_backward_layers else 0)
            for i in range(c.num_hidden_layers))
        self.norm_out = AdaLayerNormZero(c.hidden_size, 2)
        self.proj_out = nn.Linear(c.hidden_size, c.mel_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    def _rope(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
        freqs = torch.arange(length, device=device)[None, :, None].float() * inv  # [1, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [1, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def voice_rows(self, ref_mel: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The speaker encoder's vector of each row the forward runs: ``ref_mel [B, T_ref, mel]`` ->
        ``[B, enc_dim]``, or ``[2B, enc_dim]`` when guided (the unconditional rows' reference is
        zeros). A function of the voice alone: a streamed answer computes it once for all its windows."""
        if guidance_scale >= 1e-5:
            ref_mel = torch.cat([ref_mel, torch.zeros_like(ref_mel)])
        return self.input_embed.spk_encoder(ref_mel)

    def forward(self, x: torch.Tensor, t: torch.Tensor, codes: torch.Tensor, speaker: torch.Tensor,
                ref_mel: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """``x [B, T, mel]``, ``t [B]``, ``codes [B, T / repeats]``, ``speaker [B, enc_emb]``,
        ``ref_mel [B, T_ref, mel]`` -> guided velocity ``[B, T, mel]`` (``guidance_scale`` 0:
        the conditional branch alone, as transformers below 1e-5)."""
        return self.velocity(x, t, codes, speaker, self.voice_rows(ref_mel, guidance_scale), guidance_scale)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, codes: torch.Tensor, speaker: torch.Tensor,
                 voice: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """:meth:`forward` given the speaker encoder's rows (``voice``: :meth:`voice_rows`, conditional
        rows then unconditional ones when guided). ``t [B]``, or ``[1]``: one time for every row
        (windows of several requests at one ODE time), whose embedding and modulations are computed
        once and repeated per row (``_per_row``): each row's numbers are then those of a batch of one."""
        b, frames = x.shape[:2]
        speaker = speaker.unsqueeze(1).repeat(1, frames, 1)  # [B, T, enc_emb]
        cond_code = self.text_embed(codes)
        if guidance_scale < 1e-5:
            t_all, h = t, self.input_embed(x, speaker, voice, cond_code)
        else:  # conditional rows, then unconditional ones (speaker, reference and codes dropped)
            t_all = torch.cat([t, t])
            h = self.input_embed(torch.cat([x, x]), torch.cat([speaker, torch.zeros_like(speaker)]), voice,
                                 torch.cat([cond_code, self.text_embed(codes, drop_code=True)]))
        temb = self.time_embed(t_all)  # [B or 2B, D], or [1 or 2, D] for a shared time
        cos, sin = self._rope(frames, x.device, h.dtype)
        blocks = torch.arange(frames, device=x.device) // self.config.block_size
        block_diff = (blocks[None, :] - blocks[:, None]).expand(h.shape[0], self.config.num_attention_heads, frames, frames)
        for block in self.transformer_blocks:
            h = block(h, temb, cos, sin, block_diff)
        scale, shift = _per_row(self.norm_out(temb), h.shape[0])
        out = self.proj_out(_layer_norm(h) * (1 + scale)[:, None, :] + shift[:, None, :])
        if guidance_scale < 1e-5:
            return out
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * guidance_scale
