"""Qwen3-Omni checkpoints: the transformers ``Qwen3OmniMoeForConditionalGeneration`` layout.

A folder holds ``config.json`` (``thinker_config`` / ``talker_config`` / ``code2wav_config`` and the
chat-template token ids), ``model.safetensors`` (or shards + index) and the tokenizer; the voices
are ``talker_config.speaker_id`` ({name: codec id}, no separate file). Tensor names carry the part
as a prefix (``thinker.model.layers.0.mlp.experts.3.gate_proj.weight``, ``talker.code_predictor...``,
``code2wav.decoder...``); our modules keep transformers' names below it, so each part loads by
stripping the prefix. Each part is built on ``meta`` and assigned its tensors after its key set
and shapes are checked by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omniloop.models.families.qwen3_omni.audio_encoder import AudioEncoderConfig, Qwen3AudioEncoder
from omniloop.models.families.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omniloop.models.families.qwen3_omni.model import (
    ChatTokens, Qwen3DecoderConfig, Qwen3OmniTalker, Qwen3OmniThinker, TalkerTokens,
)
from omniloop.models.omni.part_weights import OmniConfigBase, load_part, load_thinker_lm, read_omni_config
from omniloop.models.omni.part_weights import load_audio_tower as load_audio_tower_part

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class Omni3Config(OmniConfigBase):
    thinker: Qwen3DecoderConfig
    talker: Qwen3DecoderConfig | None  # None: a thinker-only folder (enable_audio_output=false)
    predictor: Qwen3DecoderConfig | None
    code2wav: Code2WavConfig | None
    tokens: TalkerTokens | None
    chat: ChatTokens
    voices: dict[str, int]  # talker_config.speaker_id: name (lower case) -> codec id
    groups: int  # codebooks per speech frame
    accept_hidden_layer: int  # the thinker layer whose output the talker reads at media positions
    audio: AudioEncoderConfig | None = None  # thinker_config.audio_config (None: no audio tower described)
    vision_start_token_id: int = 151652
    audio_start_token_id: int = 151669  # <|audio_start|>: opens an audio, or a video's soundtrack (use_audio_in_video)
    position_id_per_seconds: int = 25  # the temporal plane's positions per second (thinker_config)
    talker_merge: int = 2  # talker_config.spatial_merge_size: how its prompt's image positions are laid out
    talker_position_per_second: int = 25

    @property
    def speaks(self) -> bool:
        return self.talker is not None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Omni3Config":
        try:
            thinker = raw["thinker_config"]
            text = thinker["text_config"]
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}; pass a {ARCHITECTURE} folder") from None
        eos = text.get("eos_token_id")
        speaks = raw.get("enable_audio_output", True) and "talker_config" in raw and "code2wav_config" in raw
        talker = raw.get("talker_config") or {}
        predictor = talker.get("code_predictor_config") or {}
        groups = int(talker.get("num_code_groups", 32))
        if speaks and int(predictor.get("num_code_groups", groups)) != groups:
            raise ValueError(f"talker_config.num_code_groups={groups} and its code_predictor_config.num_code_groups="
                             f"{predictor.get('num_code_groups')} disagree; they are one number in every release")
        if speaks and not talker.get("speaker_id"):
            raise ValueError("talker_config.speaker_id is empty: a spoken answer needs the voices ({name: codec id}); "
                             "pass the released folder's config.json, or set enable_audio_output=false for text only")
        c2w = Code2WavConfig.from_hf(raw["code2wav_config"]) if speaks else None
        if c2w is not None and c2w.num_quantizers != groups:
            raise ValueError(f"code2wav_config.num_quantizers={c2w.num_quantizers} must equal talker_config."
                             f"num_code_groups={groups} (one code per codebook per frame)")
        return cls(
            thinker=Qwen3DecoderConfig.from_hf(text, part="thinker"),
            talker=Qwen3DecoderConfig.from_hf(talker["text_config"], part="talker", every_layer_sparse=True) if speaks else None,
            predictor=Qwen3DecoderConfig.from_hf(predictor, part="code predictor", multimodal_rope=False) if speaks else None,
            code2wav=c2w,
            tokens=TalkerTokens(codec_eos=int(talker["codec_eos_token_id"]), codec_pad=int(talker["codec_pad_id"]),
                                codec_bos=int(talker["codec_bos_id"]), codec_nothink=int(talker["codec_nothink_id"]),
                                codec_think_bos=int(talker["codec_think_bos_id"]),
                                codec_think_eos=int(talker["codec_think_eos_id"])) if speaks else None,
            chat=ChatTokens(im_start=int(raw.get("im_start_token_id", 151644)), im_end=int(raw.get("im_end_token_id", 151645)),
                            user=int(raw.get("user_token_id", 872)), assistant=int(raw.get("assistant_token_id", 77091)),
                            system=int(raw.get("system_token_id", 8948)), tts_pad=int(raw.get("tts_pad_token_id", 151671)),
                            tts_bos=int(raw.get("tts_bos_token_id", 151672)), tts_eos=int(raw.get("tts_eos_token_id", 151673))),
            voices={str(k).lower(): int(v) for k, v in (talker.get("speaker_id") or {}).items()},
            groups=groups,
            accept_hidden_layer=int(talker.get("accept_hidden_layer", 18)),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
            audio_token_id=int(thinker.get("audio_token_id", 151646)),
            image_token_id=int(thinker.get("image_token_id", 151655)),
            video_token_id=int(thinker.get("video_token_id", 151656)),
            audio=AudioEncoderConfig.from_hf(thinker["audio_config"]) if thinker.get("audio_config") else None,
            vision_start_token_id=int(thinker.get("vision_start_token_id", 151652)),
            audio_start_token_id=int(thinker.get("audio_start_token_id", 151669)),
            position_id_per_seconds=int(thinker.get("position_id_per_seconds", 25)),
            talker_merge=int(talker.get("spatial_merge_size", 2)),
            talker_position_per_second=int(talker.get("position_id_per_seconds", 25)),
        )


def read_config(folder: Path) -> Omni3Config:
    return read_omni_config(folder, ARCHITECTURE, Omni3Config.from_hf)


def load_thinker(folder: Path, config: Omni3Config, *, device: torch.device | str, dtype: torch.dtype) -> Qwen3OmniThinker:
    with torch.device("meta"):
        model = Qwen3OmniThinker(config.thinker, config.accept_hidden_layer if config.speaks else None)
    load_thinker_lm(folder, ARCHITECTURE, model, device, dtype)
    return model.eval().requires_grad_(False)


def load_audio_tower(folder: Path, config: Omni3Config, *, device: torch.device | str,
                     dtype: torch.dtype) -> Qwen3AudioEncoder | None:
    """The thinker's audio encoder, or None (``part_weights.load_audio_tower``)."""
    audio = config.audio
    build = None if audio is None else lambda: Qwen3AudioEncoder(audio)
    return load_audio_tower_part(folder, ARCHITECTURE, build, device, dtype)


def load_talker(folder: Path, config: Omni3Config, *, device: torch.device | str, dtype: torch.dtype) -> Qwen3OmniTalker:
    assert config.talker is not None and config.predictor is not None and config.tokens is not None, (
        "the talker is loaded only for a checkpoint with audio output")
    with torch.device("meta"):
        model = Qwen3OmniTalker(config.talker, config.predictor, thinker_hidden=config.thinker.hidden_size,
                                groups=config.groups, tokens=config.tokens, chat=config.chat, voices=config.voices,
                                spatial_merge_size=config.talker_merge,
                                position_id_per_seconds=config.talker_position_per_second)
    load_part(folder, ARCHITECTURE, "talker.", model, device, dtype)
    return model


def load_code2wav(folder: Path, config: Omni3Config, *, device: torch.device | str) -> Code2Wav:
    """fp32: the codec decoder is small and its convolutions run at 24 kHz (transformers runs it
    in the checkpoint's dtype; fp32 is at least as accurate)."""
    assert config.code2wav is not None, "code2wav is loaded only for a checkpoint with audio output"
    with torch.device("meta"):
        model = Code2Wav(config.code2wav)
    load_part(folder, ARCHITECTURE, "code2wav.", model, device, torch.float32)
    return model
