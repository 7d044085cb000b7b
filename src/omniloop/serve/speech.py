"""Spoken chat answers in OpenAI's shape: ``message.audio`` / ``delta.audio``.

``modalities: ["text", "audio"]`` with ``audio: {voice, format}`` asks the model for speech;
the answer's audio artifact is encoded in ``format`` and returned as ``message.audio =
{id, data (base64), expires_at, transcript}`` with ``content`` null (OpenAI's shape: the text
is the transcript). Streamed, the transcript arrives as ``delta.audio.transcript`` deltas and
the audio as ``delta.audio.data`` (base64) with its ``id`` and ``expires_at``.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omniloop.io.audio import as_float_samples, encode_audio
from omniloop.request import AudioArtifact, Modality

AudioFormat = Literal["wav", "mp3", "flac", "pcm16"]  # OpenAI's, less opus (no encoder here)
EXPIRES_S = 3600  # the id's nominal lifetime: nothing is stored server-side, the data is in the answer


class AudioRequest(BaseModel):
    """The ``audio`` parameter: which voice speaks and how the audio is encoded."""

    model_config = ConfigDict(extra="forbid")

    voice: str = Field(min_length=1, max_length=64, description="one of the model's voices (e.g. Chelsie, Ethan)")
    format: AudioFormat = Field(description="wav, mp3, flac, or pcm16 (raw 16-bit little-endian mono)")


def wanted_modalities(modalities: Sequence[str] | None) -> list[Modality] | None:
    """The request-plane ``outputs.modalities`` of a chat request (None: the task's default, text)."""
    if modalities is None or "audio" not in modalities:
        return None
    return [Modality.TEXT, Modality.AUDIO]


def encode_speech(audio: AudioArtifact, fmt: AudioFormat) -> bytes:
    if fmt == "pcm16":
        mono = as_float_samples(audio.samples, audio.sample_rate)  # [C, N] float32
        return (np.clip(mono[0], -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
    return encode_audio(audio.samples, audio.sample_rate, fmt)


def message_audio(audio: AudioArtifact, fmt: AudioFormat, transcript: str) -> dict[str, Any]:
    """OpenAI's ``ChatCompletionAudio``: id, base64 data, expires_at, transcript."""
    return {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(encode_speech(audio, fmt)).decode("ascii"),
            "expires_at": int(time.time()) + EXPIRES_S, "transcript": transcript}
