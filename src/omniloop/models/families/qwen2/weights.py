"""Qwen2 checkpoints: transformers ``Qwen2ForCausalLM`` layout -> :class:`Qwen2LM`.

A transformers folder holds ``config.json`` and either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``. The loader checks the checkpoint's key set
against the one its config implies (errors name missing / unexpected keys in checkpoint
terms), builds the model on the ``meta`` device, reads each tensor straight to
``device``/``dtype``, fuses q/k/v and gate/up as it goes and assigns the result.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

from omniloop.models.families.qwen2.model import ARCHITECTURE, Qwen2Config, Qwen2LM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_MAX_KEYS_IN_ERROR = 12

# Checkpoint keys transformers itself ignores on load (old checkpoints saved the RoPE table).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")

# Fused projections: our linear -> its checkpoint sources, concatenated in this order.
_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER_UNFUSED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                  "mlp.down_proj.weight")


def checkpoint_keys(config: Qwen2Config) -> list[str]:
    """Every tensor name a transformers ``Qwen2ForCausalLM`` checkpoint of ``config`` holds."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        keys.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        keys += [prefix + k for k in _LAYER_UNFUSED]
        keys += [f"{prefix}{src}.weight" for srcs in _FUSED.values() for src in srcs]
        keys += [f"{prefix}self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    return keys


def state_dict_from_transformers(sd: Mapping[str, torch.Tensor], config: Qwen2Config) -> dict[str, torch.Tensor]:
    """transformers ``Qwen2ForCausalLM`` state dict -> :class:`Qwen2LM` state dict.

    Strips ``model.``, concatenates q/k/v (weights and biases) into ``qkv_proj`` and gate/up
    into ``gate_up_proj`` along the output dim, and drops ``lm_head.weight`` when the
    embeddings are tied. ``sd`` is not modified; every key of ``checkpoint_keys`` must be present.
    """
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": sd["model.embed_tokens.weight"],
                                    "norm.weight": sd["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for key in _LAYER_UNFUSED:
            out[dst + key] = sd[src + key]
        for fused, sources in _FUSED.items():
            leaves = ("weight", "bias") if fused == "self_attn.qkv_proj" else ("weight",)
            for leaf in leaves:
                out[f"{dst}{fused}.{leaf}"] = torch.cat([sd[f"{src}{s}.{leaf}"] for s in sources], dim=0)
    return out


def read_config(folder: Path) -> Qwen2Config:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a transformers {ARCHITECTURE} folder (config.json + model.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in archs:
        raise ValueError(f"{path} describes {archs}, not {ARCHITECTURE}")
    try:
        return Qwen2Config.from_hf_config(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def weight_files(folder: Path) -> list[Path]:
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) {missing} are listed in {index} but missing; re-download the checkpoint")
        return files
    raise FileNotFoundError(f"no {ARCHITECTURE} weights in {folder}: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}")


def _format_keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:_MAX_KEYS_IN_ERROR])
    more = len(keys) - _MAX_KEYS_IN_ERROR
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def _read_tensors(files: list[Path], device: torch.device, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in skip or _IGNORED.search(key):
                    continue
                t = f.get_tensor(key)
                sd[key] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    return sd


def _checkpoint_key_set(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys.update(k for k in f.keys() if not _IGNORED.search(k))
    return keys


def load_qwen2(folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Qwen2LM:
    """Load a transformers ``Qwen2ForCausalLM`` folder as :class:`Qwen2LM` on ``device`` in ``dtype``."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.bfloat16, torch.float32, ...); got {dtype}")
    folder, device = Path(folder), torch.device(device)
    config = read_config(folder)
    files = weight_files(folder)

    # 1. key sets first: nothing is read when the checkpoint cannot match its config
    expected = set(checkpoint_keys(config))
    present = _checkpoint_key_set(files)
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: transformers ignores it too
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - skip)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match its config.json: missing keys {_format_keys(missing)}, "
            f"unexpected keys {_format_keys(unexpected)}; pass a transformers {ARCHITECTURE} folder whose "
            "config.json describes its weights"
        )
    # 2. read, map and check shapes against a meta-device model
    sd = state_dict_from_transformers(_read_tensors(files, device, dtype, skip), config)
    with torch.device("meta"):
        model = Qwen2LM(config)
    shapes = model.state_dict()
    assert set(shapes) == set(sd), f"key mapping out of sync with Qwen2LM: {sorted(set(shapes) ^ set(sd))}"
    wrong = [f"{k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in shapes.items() if sd[k].shape != v.shape]
    if wrong:
        raise ValueError(f"checkpoint {folder} has weights of the wrong shape (ours after fusing vs config): {_format_keys(wrong)}")
    # 3. assign (no second copy of the weights)
    model.load_state_dict(sd, strict=True, assign=True)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval().requires_grad_(False)
