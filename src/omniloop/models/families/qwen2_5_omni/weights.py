"""Qwen2.5-Omni checkpoints: the transformers ``Qwen2_5OmniForConditionalGeneration`` layout.

A folder holds ``config.json`` (``thinker_config`` / ``talker_config`` / ``token2wav_config``),
``model.safetensors`` (or shards + index), ``spk_dict.pt`` (the voices) and the tokenizer.
Tensor names carry the part as a prefix (``thinker.model.layers.0...``, ``talker.codec_head``,
``token2wav.code2wav_dit_model...``, ``token2wav.code2wav_bigvgan_model...``); our modules keep
transformers' names below the prefix, so each part loads by stripping it. Each part is built
on ``meta`` and assigned its tensors after its key set and shapes are checked by name.

The thinker's audio encoder (``thinker.audio_tower.*``, ``audio_encoder.py``) and vision
encoder (``thinker.visual.*``, ``vision_encoder.py``) load as their own components.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omniloop.models.checkpoint_files import aligned, cast_to, read_tensors, weight_files
from omniloop.models.families.qwen2_5_omni.audio_encoder import AudioEncoderConfig, OmniAudioEncoder
from omniloop.models.families.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig
from omniloop.models.families.qwen2_5_omni.dit import DiTConfig, Token2WavDiT
from omniloop.models.families.qwen2_5_omni.model import DecoderConfig, OmniTalker, OmniThinker, TalkerTokens
from omniloop.models.families.qwen2_5_omni.vision_encoder import OmniVisionEncoder, VisionEncoderConfig
from omniloop.models.omni.part_weights import (
    WEIGHTS_FILE, WEIGHTS_INDEX_FILE, OmniConfigBase, has_part, load_part, load_thinker_lm, read_omni_config,
)
from omniloop.models.omni.part_weights import load_audio_tower as load_audio_tower_part

ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
SPEAKERS_FILE = "spk_dict.pt"
VISION_TOWER_PREFIX = "thinker.visual."


@dataclass(frozen=True, kw_only=True)
class OmniConfig(OmniConfigBase):
    thinker: DecoderConfig
    talker: DecoderConfig
    tokens: TalkerTokens
    dit: DiTConfig
    bigvgan: BigVGANConfig
    audio_start_token_id: int  # <|audio_bos|> / <|audio_eos|>: they frame a video's soundtrack (use_audio_in_video)
    audio_end_token_id: int
    audio: AudioEncoderConfig | None  # thinker_config.audio_config (None: the checkpoint describes no audio tower)
    vision: VisionEncoderConfig | None = None  # thinker_config.vision_config

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "OmniConfig":
        try:
            thinker, talker, t2w = raw["thinker_config"], raw["talker_config"], raw["token2wav_config"]
            text = thinker["text_config"]
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}; pass a {ARCHITECTURE} folder saved with its talker "
                             "and token2wav (enable_audio_output=true)") from None
        if raw.get("enable_audio_output") is False:
            raise ValueError("config.json has enable_audio_output=false: this checkpoint has no talker/token2wav; "
                             "pass the full Qwen2.5-Omni folder")
        thinker_cfg = DecoderConfig.from_hf(text)
        eos = text.get("eos_token_id")
        return cls(
            thinker=thinker_cfg,
            talker=DecoderConfig.from_hf(talker, embedding_size=talker.get("embedding_size", thinker_cfg.hidden_size)),
            tokens=TalkerTokens(
                codec_bos=int(talker["tts_codec_start_token_id"]), codec_eos=int(talker["tts_codec_end_token_id"]),
                codec_pad=int(talker["tts_codec_pad_token_id"]), codec_mask=int(talker["tts_codec_mask_token_id"]),
                text_bos=int(talker["tts_text_start_token_id"]), text_eos=int(talker["tts_text_end_token_id"]),
                text_pad=int(talker["tts_text_pad_token_id"])),
            dit=DiTConfig.from_hf(t2w["dit_config"]),
            bigvgan=BigVGANConfig.from_hf(t2w["bigvgan_config"]),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
            audio_token_id=int(thinker.get("audio_token_index", 151646)),
            image_token_id=int(thinker.get("image_token_index", 151655)),
            video_token_id=int(thinker.get("video_token_index", 151656)),
            audio_start_token_id=int(thinker.get("audio_start_token_id", 151647)),
            audio_end_token_id=int(thinker.get("audio_end_token_id", 151648)),
            audio=AudioEncoderConfig.from_hf(thinker["audio_config"]) if thinker.get("audio_config") else None,
            vision=VisionEncoderConfig.from_hf(thinker["vision_config"]) if thinker.get("vision_config") else None,
        )


def read_config(folder: Path) -> OmniConfig:
    return read_omni_config(folder, ARCHITECTURE, OmniConfig.from_hf)


def load_thinker(folder: Path, config: OmniConfig, *, device: torch.device | str, dtype: torch.dtype) -> OmniThinker:
    with torch.device("meta"):
        model = OmniThinker(config.thinker)
    load_thinker_lm(folder, ARCHITECTURE, model, device, dtype)
    return model.eval().requires_grad_(False)


def load_audio_tower(folder: Path, config: OmniConfig, *, device: torch.device | str,
                     dtype: torch.dtype) -> OmniAudioEncoder | None:
    """The thinker's audio encoder, or None (``part_weights.load_audio_tower``)."""
    audio = config.audio
    build = None if audio is None else lambda: OmniAudioEncoder(audio)
    return load_audio_tower_part(folder, ARCHITECTURE, build, device, dtype)


def load_vision_tower(folder: Path, config: OmniConfig, *, device: torch.device | str,
                      dtype: torch.dtype) -> OmniVisionEncoder | None:
    """The thinker's vision encoder (``thinker.visual.*``), or None when the checkpoint has none."""
    if config.vision is None or not has_part(folder, ARCHITECTURE, VISION_TOWER_PREFIX):
        return None
    with torch.device("meta"):
        model = OmniVisionEncoder(config.vision)
    load_part(folder, ARCHITECTURE, VISION_TOWER_PREFIX, model, device, dtype)
    return model


def load_talker(folder: Path, config: OmniConfig, *, device: torch.device | str, dtype: torch.dtype) -> OmniTalker:
    with torch.device("meta"):
        model = OmniTalker(config.talker, config.tokens)
    load_part(folder, ARCHITECTURE, "talker.", model, device, dtype)
    return model


def load_dit(folder: Path, config: OmniConfig, *, device: torch.device | str) -> Token2WavDiT:
    """fp32 always: transformers runs token2wav in fp32 whatever the rest's dtype."""
    with torch.device("meta"):
        model = Token2WavDiT(config.dit)
    load_part(folder, ARCHITECTURE, "token2wav.code2wav_dit_model.", model, device, torch.float32)
    return model


def load_bigvgan(folder: Path, config: OmniConfig, *, device: torch.device | str) -> BigVGAN:
    model = BigVGAN(config.bigvgan).to(device)  # built for real: its Kaiser filters are computed buffers
    state = {k: v for k, v in model.state_dict().items()}
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, ARCHITECTURE)
    prefix = "token2wav.code2wav_bigvgan_model."
    tensors = read_tensors(files, aligned(cast_to(device, torch.float32)), skip=lambda key: not key.startswith(prefix))
    sd = {key[len(prefix):]: t for key, t in tensors.items()}
    missing, unexpected = sorted(set(state) - set(sd)), sorted(set(sd) - set(state))
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} ({prefix}*) does not match its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    model.load_state_dict(sd, strict=True)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class Speaker:
    """One voice of ``spk_dict.pt``: the talker's text-start token and token2wav's conditioning."""

    bos_token: int  # a thinker token id the talker's prompt embeds after the conversation
    cond: torch.Tensor  # [1, enc_emb_dim] speaker embedding
    ref_mel: torch.Tensor  # [1, T_ref, mel_dim] reference mel (log amplitude)


def load_speakers(folder: Path, *, device: torch.device | str) -> dict[str, Speaker]:
    path = folder / SPEAKERS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: Qwen2.5-Omni checkpoints ship their voices in {SPEAKERS_FILE} "
                                "({name: {bos_token, cond, ref_mel}}); copy it next to config.json")
    raw = torch.load(path, weights_only=True, map_location="cpu")
    out = {}
    for name, entry in raw.items():
        cond, ref = entry["cond"].float(), entry["ref_mel"].float()
        out[str(name)] = Speaker(bos_token=int(entry["bos_token"]), cond=cond.reshape(1, -1).to(device),
                                 ref_mel=ref.reshape(1, -1, ref.shape[-1]).to(device))
    if not out:
        raise ValueError(f"{path} holds no voices")
    return out
