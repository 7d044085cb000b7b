"""Qwen3-Omni's audio encoder (``thinker.audio_tower.*``): Whisper-style log-mel features -> one
embedding per 80 ms of audio, in the thinker's hidden size (transformers' ``Qwen3OmniMoeAudioEncoder``,
its module names).

1. each audio's mel frames ``[mel, T]`` are cut into chunks of ``2 * n_window`` frames (its last
   chunk shorter), right-padded to the longest;
2. three stride-2 ``Conv2d`` (GELU) over (mel, time) per chunk, flattened and ``conv_out`` to
   ``d_model``, plus the sinusoidal position table from 0 in every chunk; the chunks' real frames
   are packed;
3. ``encoder_layers`` pre-LN blocks (``omniloop.models.omni.audio_layers``) whose attention stays
   inside windows of ``n_window_infer / (2 n_window)`` chunks of an audio (transformers'
   ``get_audio_cu_seqlens``);
4. ``ln_post``, ``proj1``, GELU, ``proj2`` to ``output_dim``.

An audio of ``T`` frames gives :func:`audio_tokens` embeddings (transformers'
``_get_feat_extract_output_lengths``); the prompt holds that many audio placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.omni.audio_layers import (
    AudioEncoderLayer, AudioEncoderModule, AudioLayerDims, AudioTowerConfig, SinusoidsPositionEmbedding,
    padded_chunks,
)


@dataclass(frozen=True, kw_only=True)
class AudioEncoderConfig(AudioTowerConfig):
    """``thinker_config.audio_config`` of the checkpoint."""

    n_window: int  # half a chunk, in mel frames
    n_window_infer: int  # an attention window, in mel frames (a whole number of chunks)
    downsample_hidden_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_window_infer % (2 * self.n_window):
            raise ValueError(f"audio_config: n_window_infer={self.n_window_infer} must be a multiple of 2 * n_window="
                             f"{2 * self.n_window} (an attention window holds whole chunks)")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "AudioEncoderConfig":
        return cls(**AudioTowerConfig.shared_fields(d), n_window=int(d.get("n_window", 50)),
                   n_window_infer=int(d.get("n_window_infer", 800)),
                   downsample_hidden_size=int(d.get("downsample_hidden_size", 480)))


def _conv_len(n: int) -> int:
    """Frames after one stride-2, k3, pad-1 convolution."""
    return (n - 1) // 2 + 1


def audio_tokens(frames: int, n_window: int) -> int:
    """Embeddings of an audio of ``frames`` mel frames: three halvings of each chunk of ``2 * n_window``
    frames. NOTE: transformers' ``_get_feat_extract_output_lengths`` (what its processor counts
    placeholders by) writes 13 per whole chunk: the halvings of 100 frames, the released n_window 50."""
    whole, rest = divmod(frames, 2 * n_window)
    per_chunk = _conv_len(_conv_len(_conv_len(2 * n_window)))
    return whole * per_chunk + (_conv_len(_conv_len(_conv_len(rest))) if rest else 0)


class Qwen3AudioEncoder(AudioEncoderModule):
    """transformers' ``Qwen3OmniMoeAudioEncoder``: mel features -> audio embeddings."""

    def __init__(self, c: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = c
        h = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, h, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(h, h, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(h, h, 3, 2, padding=1)
        self.conv_out = nn.Linear(h * _conv_len(_conv_len(_conv_len(c.num_mel_bins))), c.d_model, bias=False)
        self.positional_embedding = SinusoidsPositionEmbedding(c.max_source_positions, c.d_model)
        dims = AudioLayerDims(c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim, k_bias=True)
        self.layers = nn.ModuleList(AudioEncoderLayer(dims) for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj1 = nn.Linear(c.d_model, c.d_model)
        self.proj2 = nn.Linear(c.d_model, c.output_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj2.weight.dtype

    def tokens(self, frames: int) -> int:
        """Embeddings of an audio of ``frames`` mel frames (``audio_prompt.AudioTower``)."""
        return audio_tokens(frames, self.config.n_window)

    def _windows(self, lengths: Sequence[int], chunk_tokens: int) -> list[int]:
        """Packed frames per attention window: each audio's tokens cut every ``chunk_tokens *
        n_window_infer / (2 n_window)`` (``chunk_tokens``: the longest chunk's, as transformers counts)."""
        c = self.config
        window = chunk_tokens * (c.n_window_infer // (2 * c.n_window))
        out: list[int] = []
        for n in lengths:
            tokens = self.tokens(n)
            out += [window] * (tokens // window) + ([tokens % window] if tokens % window else [])
        return out

    def forward(self, features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """``features [mel, sum(lengths)]`` (the audios' valid mel frames, concatenated) ->
        ``[sum(tokens(n)), output_dim]``, audio after audio."""
        c = self.config
        lengths = [int(n) for n in lengths]
        assert features.shape[1] == sum(lengths), f"{features.shape[1]} frames for audio lengths {lengths}"
        # 1. chunks, padded: [C, 1, mel, F]
        chunks, sizes = padded_chunks(features.to(self.dtype), lengths, c.n_window)
        padded = chunks[:, None]
        # 2. conv front end: [C, F', d] + positions; the real frames packed: [N, d]
        h = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(padded))))))
        b, ch, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(b, t, ch * f))
        h = h + self.positional_embedding.positional_embedding[:t].unsqueeze(0).to(h.dtype)
        after = [_conv_len(_conv_len(_conv_len(s))) for s in sizes]
        keep = torch.arange(t, device=h.device) < torch.tensor(after, device=h.device)[:, None]
        x = h.reshape(-1, h.shape[-1])[keep.flatten().nonzero().squeeze(-1)]
        # 3. blocks, attention inside each window
        windows = self._windows(lengths, max(after))
        for layer in self.layers:
            x = layer(x, windows)
        # 4. head
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))
