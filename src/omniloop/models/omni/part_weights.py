"""An omni checkpoint's config and tensors, part by part. A transformers omni folder keeps every
part (``thinker.model.``, ``thinker.audio_tower.``, ``talker.``, the speech decoder's) in one
``model.safetensors`` (or shards + index) under its prefix; our modules keep transformers' names
below it, so a part loads by stripping the prefix into a module built on ``meta``, after its key
set and shapes are checked by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import nn

from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign, read_tensors, stored_keys, weight_files
from omniloop.models.omni.audio_layers import AudioEncoderModule
from omniloop.models.omni.decoder_config import TextDecoderConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
AUDIO_TOWER_PREFIX = "thinker.audio_tower."

C = TypeVar("C")
A = TypeVar("A", bound=AudioEncoderModule)


@dataclass(frozen=True, kw_only=True)
class OmniConfigBase:
    """What both omni checkpoints' configs (Qwen2.5-Omni's, Qwen3-Omni's) say of the thinker's
    prompt: its text decoder (the context it serves), its stop ids and the placeholder ids its
    audio / image / video parts take. A family's config subclasses it (narrowing ``thinker`` to
    its decoder config) and adds its parts."""

    thinker: TextDecoderConfig
    eos_token_ids: tuple[int, ...]  # the thinker's
    audio_token_id: int
    image_token_id: int
    video_token_id: int


def read_omni_config(folder: Path, architecture: str, from_hf: Callable[[dict[str, Any]], C]) -> C:
    """``folder/config.json`` of ``architecture``, parsed by ``from_hf``; its errors name the file."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a transformers {architecture} folder")
    raw = json.loads(path.read_text())
    if architecture not in (raw.get("architectures") or [architecture]):
        raise ValueError(f"{path} describes {raw.get('architectures')}, not {architecture}")
    try:
        return from_hf(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def has_part(folder: Path, architecture: str, prefix: str) -> bool:
    """Whether the checkpoint stores any tensor under ``prefix`` (an optional encoder's)."""
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, architecture)
    return any(k.startswith(prefix) for k in stored_keys(files))


def load_part(folder: Path, architecture: str, prefix: str, model: nn.Module, device: torch.device | str,
              dtype: torch.dtype, skip: tuple[str, ...] = ()) -> nn.Module:
    """The tensors under ``prefix`` (but not under ``skip`` prefixes) assigned to ``model`` (built on
    meta), prefix stripped; missing / unexpected / wrong-shape keys are named."""
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, architecture)
    tensors = read_tensors(files, aligned(cast_to(device, dtype)),
                           skip=lambda key: not key.startswith(prefix) or key.startswith(skip))
    sd = {key[len(prefix):]: t for key, t in tensors.items()}
    check_and_assign(model, sd, f"{folder} ({prefix}*)", f"pass a transformers {architecture} folder whose "
                     "config.json describes its weights")
    for name, buf in model.named_buffers():  # non-persistent buffers (filters) are rebuilt off meta
        assert not buf.is_meta, f"buffer {name} still on meta"
    return model.eval().requires_grad_(False)


class ThinkerLM(Protocol):
    """A thinker's text path as transformers names it: ``model`` (the decoder) + ``lm_head``."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def lm_head(self) -> nn.Module: ...


def load_thinker_lm(folder: Path, architecture: str, thinker: ThinkerLM, device: torch.device | str,
                    dtype: torch.dtype) -> None:
    """A thinker built on meta: ``thinker.model.*`` into its ``model``, ``thinker.lm_head.*`` into
    its ``lm_head`` (its audio / vision towers are components of their own)."""
    load_part(folder, architecture, "thinker.model.", thinker.model, device, dtype)
    load_part(folder, architecture, "thinker.lm_head.", thinker.lm_head, device, dtype)


def load_audio_tower(folder: Path, architecture: str, build: Callable[[], A] | None, device: torch.device | str,
                     dtype: torch.dtype) -> A | None:
    """The thinker's audio encoder (``thinker.audio_tower.*``) as ``build`` makes it (None: the
    config has no ``audio_config``), or None when the checkpoint holds none of its tensors (then
    audio inputs are refused at admission)."""
    if build is None or not has_part(folder, architecture, AUDIO_TOWER_PREFIX):
        return None
    with torch.device("meta"):
        model = build()
    model.rebuild_buffers(device)  # the position table is computed, not stored
    load_part(folder, architecture, AUDIO_TOWER_PREFIX, model, device, dtype)
    return model
