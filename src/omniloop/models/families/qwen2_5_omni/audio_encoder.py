"""Qwen2.5-Omni's audio encoder (``thinker.audio_tower.*``): Whisper-style log-mel features ->
one embedding per 40 ms of audio, in the thinker's hidden size.

transformers' ``Qwen2_5OmniAudioEncoder``, module for module (its names, so the checkpoint's
tensors load by stripping ``thinker.audio_tower.``):

1. the mel frames ``[mel, T]`` of every audio of a request are cut into chunks of
   ``2 * n_window`` frames (an audio's last chunk shorter), right-padded to the longest;
2. ``conv1`` (k3, GELU; padded frames zeroed) and ``conv2`` (k3 stride 2, GELU) per chunk, plus
   the sinusoidal position table from 0 in every chunk;
3. ``encoder_layers`` pre-LN transformer blocks whose attention stays inside a chunk (the
   ``cu_seqlens`` windows: bidirectional within, nothing across);
4. per audio, average-pool pairs of frames (stride 2), ``ln_post``, ``proj`` to ``output_dim``.

An audio of ``T`` mel frames gives ``((T - 1) // 2 + 1 - 2) // 2 + 1`` embeddings
(:func:`audio_tokens`); the prompt holds that many ``<|AUDIO|>`` placeholders.
The module holds no request state.
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

    n_window: int  # half a chunk, in mel frames (a chunk: 2 * n_window frames)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_window > self.max_source_positions:
            raise ValueError(f"audio_config: n_window={self.n_window} exceeds max_source_positions="
                             f"{self.max_source_positions} (a chunk's frames after conv2 index the position table)")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "AudioEncoderConfig":
        return cls(**AudioTowerConfig.shared_fields(d), n_window=int(d.get("n_window", 100)))


def audio_tokens(frames: int) -> int:
    """Embeddings (prompt placeholders) of an audio of ``frames`` mel frames: conv2 halves, the
    pool halves again (transformers' ``_get_feat_extract_output_lengths``)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class OmniAudioEncoder(AudioEncoderModule):
    """transformers' ``Qwen2_5OmniAudioEncoder``: mel features -> audio embeddings."""

    def __init__(self, c: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = SinusoidsPositionEmbedding(c.max_source_positions, c.d_model)
        self.audio_bos_eos_token = nn.Embedding(2, c.output_dim)  # in the checkpoint; the forward never reads it
        dims = AudioLayerDims(c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim, k_bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(dims) for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj = nn.Linear(c.d_model, c.output_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    @staticmethod
    def tokens(frames: int) -> int:
        """Embeddings of an audio of ``frames`` mel frames (``audio_prompt.AudioTower``)."""
        return audio_tokens(frames)

    def forward(self, features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """``features [mel, sum(lengths)]`` (the audios' valid mel frames, concatenated) ->
        ``[sum(audio_tokens(n) for n in lengths), output_dim]`` embeddings, audio after audio."""
        lengths = [int(n) for n in lengths]
        assert features.shape[1] == sum(lengths), f"{features.shape[1]} frames for audio lengths {lengths}"
        # 1. chunks, padded: [C, mel, F]
        padded, sizes = padded_chunks(features.to(self.dtype), lengths, self.config.n_window)
        frame = torch.arange(padded.shape[2], device=padded.device)
        valid = (frame < torch.tensor(sizes, device=padded.device)[:, None]).unsqueeze(1).long()  # [C, 1, F]
        # 2. conv front end + positions: [C, F', d]
        h = F.gelu(self.conv1(padded)) * valid
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        h = h + self.positional_embedding.positional_embedding[: h.shape[1], :].unsqueeze(0).to(h.dtype)
        after_conv = [(s - 1) // 2 + 1 for s in sizes]
        keep = (torch.arange(h.shape[1], device=h.device) < torch.tensor(after_conv, device=h.device)[:, None])
        x = h.reshape(-1, h.shape[-1])[keep.flatten().nonzero().squeeze(-1)]  # [N, d] the chunks' real frames, packed
        # 3. blocks, attention inside each chunk
        for layer in self.layers:
            x = layer(x, after_conv)
        # 4. per audio: mean of frame pairs (an odd last frame dropped), ln_post, proj
        per_audio = [(n - 1) // 2 + 1 for n in lengths]
        starts = torch.tensor([0] + per_audio[:-1], device=x.device).cumsum(0)
        pairs = torch.cat([start + 2 * torch.arange((n - 2) // 2 + 1, device=x.device)
                           for start, n in zip(starts.tolist(), per_audio)])
        x = (x[pairs] + x[pairs + 1]) / 2
        return self.proj(self.ln_post(x))
