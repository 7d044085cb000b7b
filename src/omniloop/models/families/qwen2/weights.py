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
from typing import Mapping

import torch
from omniloop.models.checkpoint_files import (
    cast_to, check_float_dtype, check_keys, check_shapes, read_tensors, stored_keys, weight_files,
)

from omniloop.models.families.qwen2.model import ARCHITECTURE, Qwen2Config, Qwen2LM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


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


def load_qwen2(folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Qwen2LM:
    """Load a transformers ``Qwen2ForCausalLM`` folder as :class:`Qwen2LM` on ``device`` in ``dtype``."""
    check_float_dtype(dtype)
    folder, device = Path(folder), torch.device(device)
    config = read_config(folder)
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, ARCHITECTURE)

    # 1. key sets first: nothing is read when the checkpoint cannot match its config
    expected = set(checkpoint_keys(config))
    present = {k for k in stored_keys(files) if not _IGNORED.search(k)}
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: transformers ignores it too
    check_keys(expected, present - skip, str(folder),
               f"pass a transformers {ARCHITECTURE} folder whose config.json describes its weights")
    # 2. read, map and check shapes against a meta-device model
    tensors = read_tensors(files, cast_to(device, dtype), skip=lambda key: key in skip or bool(_IGNORED.search(key)))
    sd = state_dict_from_transformers(tensors, config)
    with torch.device("meta"):
        model = Qwen2LM(config)
    shapes = model.state_dict()
    assert set(shapes) == set(sd), f"key mapping out of sync with Qwen2LM: {sorted(set(shapes) ^ set(sd))}"
    check_shapes(sd, shapes, str(folder), "ours after fusing vs config")
    # 3. assign (no second copy of the weights)
    model.load_state_dict(sd, strict=True, assign=True)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval().requires_grad_(False)
