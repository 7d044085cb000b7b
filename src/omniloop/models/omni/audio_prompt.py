"""Audio in an omni conversation (Qwen2.5-Omni, Qwen3-Omni): audio parts -> 16 kHz mono samples ->
Whisper log-mel features (the checkpoint's ``WhisperFeatureExtractor``, as the processor calls it)
-> the family's audio encoder -> embeddings that replace the prompt's audio placeholders.

The chat template renders one ``<|audio_bos|><|AUDIO|><|audio_eos|>`` (Qwen3-Omni:
``<|audio_start|><|audio_pad|><|audio_end|>``) per audio part; like the processor, each
placeholder becomes as many as its audio has embeddings (the tower's ``tokens`` of its mel frames). Audio-only prompts keep 1-D positions (transformers'
``get_rope_index`` takes its text path when no image or video grid is given), so the thinker's
rotary positions stay the context index.

Limits (admission, ``validate.py``): at most ``chunk_length`` seconds per part (the feature
extractor's window, 30 s for the released model: transformers truncates past it, we refuse),
at least 3 mel frames (one embedding); decoding stops at the cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from omniloop.io.audio import read_audio_mono
from omniloop.request import AudioPart, InvalidRequest, OmniRequest

SAMPLE_RATE = 16000  # what the processor hands the feature extractor (qwen-omni-utils loads audio at 16 kHz)
MIN_FRAMES = 3  # the fewest mel frames that give one embedding


class AudioTower(Protocol):
    """A thinker's audio encoder: the audios' valid mel frames -> their embeddings, audio after audio."""

    def __call__(self, features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """``features [mel, sum(lengths)]`` -> ``[sum(tokens(n)), D]``."""
        ...

    def tokens(self, frames: int) -> int:
        """Embeddings (prompt placeholders) of an audio of ``frames`` mel frames."""
        ...


@dataclass(frozen=True)
class AudioInput:
    """One audio part of a request, decoded: its index among ``request.inputs`` (errors name it)."""

    part: int
    samples: np.ndarray  # [N] float32, 16 kHz mono


def audio_parts(request: OmniRequest) -> list[tuple[int, AudioPart]]:
    return [(i, p) for i, p in enumerate(request.inputs) if isinstance(p, AudioPart)]


def max_seconds(feature_extractor: Any) -> float:
    return float(feature_extractor.n_samples) / float(feature_extractor.sampling_rate)


def decode_audio(index: int, part: AudioPart, feature_extractor: Any) -> AudioInput:
    """An audio part as 16 kHz mono float32; bad input is an InvalidRequest naming ``inputs[index]``."""
    field = f"inputs[{index}]"
    cap = max_seconds(feature_extractor)
    try:
        if part.data is not None:  # in-process samples: [N] or [1, N] at part.sample_rate (16 kHz required)
            samples = np.asarray(part.data.cpu() if isinstance(part.data, torch.Tensor) else part.data, np.float32)
            if (part.sample_rate or SAMPLE_RATE) != SAMPLE_RATE or samples.ndim > 2 or samples.ndim == 2 and samples.shape[0] != 1:
                raise ValueError(f"in-process audio must be mono [N] samples at {SAMPLE_RATE} Hz; pass a wav/mp3 "
                                 "file (b64 or path) to have it resampled")
            samples = samples.reshape(-1)
            if samples.shape[0] > cap * SAMPLE_RATE:
                raise ValueError(f"the audio is {samples.shape[0] / SAMPLE_RATE:.1f} s long, over the {cap:g} s this "
                                 f"model reads; send at most {cap:g} s")
        else:
            source: Any = part.raw_bytes() if part.b64 is not None else open(str(part.path), "rb")
            try:
                samples = read_audio_mono(source, SAMPLE_RATE, cap)
            finally:
                if not isinstance(source, bytes):
                    source.close()
    except (ValueError, OSError) as e:
        raise InvalidRequest(f"{field}: {e}", fields=(field,)) from None
    if -(-samples.shape[0] // feature_extractor.hop_length) < MIN_FRAMES:
        raise InvalidRequest(f"{field}: the audio has {samples.shape[0]} samples, too short for one audio embedding "
                             f"(at least {(MIN_FRAMES - 1) * feature_extractor.hop_length * 1000 // SAMPLE_RATE} ms)",
                             hint="send a longer clip", fields=(field,))
    return AudioInput(part=index, samples=samples)


def features(feature_extractor: Any, audio: AudioInput) -> torch.Tensor:
    """``[mel, frames]`` log-mel features of the valid frames: the processor's call (padded to
    the extractor's window, its attention mask marking the frames the audio covers)."""
    out = feature_extractor(audio.samples, sampling_rate=SAMPLE_RATE, padding="max_length",
                            return_attention_mask=True, return_tensors="pt")
    frames = int(out["attention_mask"][0].sum())
    return out["input_features"][0, :, :frames]


def frames_of(feature_extractor: Any, audio: AudioInput) -> int:
    """Mel frames the feature extractor marks valid for ``audio`` (one per hop it starts in)."""
    return -(-audio.samples.shape[0] // feature_extractor.hop_length)


def expand_placeholders(ids: Sequence[int], token: int, counts: Sequence[int]) -> list[int]:
    """Each occurrence of ``token`` in ``ids`` repeated ``counts[k]`` times (the k-th part's)."""
    return replace_placeholders(ids, token, [[token] * n for n in counts])


def replace_placeholders(ids: Sequence[int], token: int, replacements: Sequence[Sequence[int]]) -> list[int]:
    """The k-th occurrence of ``token`` in ``ids`` replaced by ``replacements[k]``."""
    out: list[int] = []
    k = 0
    for t in ids:
        if t == token:
            assert k < len(replacements), "more placeholders than media parts"
            out += replacements[k]
            k += 1
        else:
            out.append(t)
    assert k == len(replacements), f"{len(replacements)} media parts but {k} placeholders"
    return out


def count_placeholders(ids: Sequence[int], token: int, parts: int, kind: str) -> None:
    """The rendered conversation has one placeholder per ``kind`` part (else an InvalidRequest)."""
    found = sum(1 for t in ids if t == token)
    if found != parts:
        raise InvalidRequest(f"the conversation renders {found} {kind} placeholders for {parts} {kind} parts (the "
                             f"chat template places one per {kind} content entry; the text may not spell the "
                             "placeholder token itself)", hint=f"send each {kind} as its own {kind} part",
                             fields=("inputs",))


def audio_embeds(tower: AudioTower, feature_extractor: Any, audios: Sequence[AudioInput],
                 device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each audio's embeddings ``[tokens, D]``: the encoder run once over all of the request's
    audios, as transformers' ``get_audio_features`` runs it."""
    mels = [features(feature_extractor, a) for a in audios]
    lengths = [m.shape[1] for m in mels]
    out = tower(torch.cat(mels, dim=1).to(device), lengths).to(dtype)  # [sum(tokens), D]
    return list(out.split([tower.tokens(n) for n in lengths]))
