"""WAV writing for audio artifacts (16-bit PCM through the standard library)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import torch


def wav_bytes(samples: torch.Tensor, sample_rate: int) -> bytes:
    """``samples`` [channels, num_samples] float in [-1, 1] -> a 16-bit PCM WAV file."""
    if samples.ndim != 2:
        raise ValueError(f"audio samples must be [channels, num_samples], got {tuple(samples.shape)}")
    if sample_rate < 1:
        raise ValueError(f"sample_rate must be >= 1, got {sample_rate}")
    pcm = (samples.detach().float().clamp(-1, 1) * 32767.0).round().to(torch.int16)  # [C, N]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(int(pcm.shape[0]))
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.t().contiguous().cpu().numpy().tobytes())  # interleaved frames
    return buf.getvalue()


def write_wav(samples: torch.Tensor, sample_rate: int, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wav_bytes(samples, sample_rate))
    return path
