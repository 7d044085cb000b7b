"""Cosmos3 checkpoints -> :class:`Cosmos3Transformer`.

Two published layouts carry the same tensors:

* diffusers' pipeline folder: ``transformer/diffusion_pytorch_model.safetensors`` with the
  flat layout (``layers.{i}.self_attn.to_q``, ``add_q_proj`` for the generation pathway,
  ``mlp`` / ``mlp_moe_gen``, ``lm_head``, ``proj_in`` ...);
* the unified checkpoint transformers' ``Cosmos3OmniForConditionalGeneration`` loads: the
  same flat keys in ``model.safetensors`` (plus the ViT under ``blocks.*`` / ``merger.*`` /
  ``patch_embed.*`` / ``pos_embed.*`` / ``deepstack_merger_list.*``), or, saved by
  transformers itself, ``model.language_model.*`` with Qwen3-VL names (``q_proj``, ``q_norm``).

Both are normalized to the flat diffusers names first (:func:`flat_name`), then mapped to
ours (:func:`state_dict_from_flat`): per-pathway modules under ``layers.{i}.pathways.{und,gen}``
with Q/K/V and gate/up concatenated. A reasoner-only load drops the generator keys, as
transformers does. The module is built on ``meta`` and the tensors assigned (one copy).
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
from omniloop.models.families.cosmos3.model import Cosmos3Config, Cosmos3Transformer

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMERS_WEIGHTS = "model.safetensors"
TRANSFORMERS_INDEX = "model.safetensors.index.json"

# transformers' _COSMOS3_DROPPED_UNIFIED_CHECKPOINT_KEYS: what the reasoner does not load
GENERATOR_KEYS = re.compile(
    r"\.add_q_proj\.|\.add_k_proj\.|\.add_v_proj\.|\.to_add_out\.|\.norm_added_q\.|\.norm_added_k\.|moe_gen"
    r"|^proj_out\.|^proj_in\.|^time_embedder\.|^audio_proj_out\.|^audio_proj_in\.|^audio_modality_embed$"
    r"|^action_proj_out\.|^action_proj_in\.|^action_modality_embed$"
)
VISION_TOWER_KEYS = re.compile(r"^(blocks|merger|patch_embed|pos_embed|deepstack_merger_list)\.|^model\.visual\.")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_TRANSFORMERS_NAMES = (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("o_proj", "to_out"),
                       ("q_norm", "norm_q"), ("k_norm", "norm_k"))

# flat (diffusers) per-layer names -> ours, per pathway
_ATTN = {"und": ("to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k"),
         "gen": ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q", "norm_added_k")}
_BLOCK = {"und": ("input_layernorm", "post_attention_layernorm", "mlp"),
          "gen": ("input_layernorm_moe_gen", "post_attention_layernorm_moe_gen", "mlp_moe_gen")}
KEEP_FP32 = re.compile(r"^time_embedder\.")  # diffusers' _keep_in_fp32_modules


def flat_name(key: str) -> str:
    """A transformers-layout key -> the flat diffusers name (flat keys pass through)."""
    if key.startswith("model.language_model."):
        key = key[len("model.language_model."):]
        for theirs, flat in _TRANSFORMERS_NAMES:
            key = key.replace(f".self_attn.{theirs}.", f".self_attn.{flat}.")
    return key


def checkpoint_keys(config: Cosmos3Config) -> list[str]:
    """Every flat tensor name a checkpoint of ``config`` holds."""
    c = config
    keys = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    pathways = ("und", "gen") if c.generator else ("und",)
    bias = ("weight", "bias") if c.attention_bias else ("weight",)
    mlp = ("gate_proj", "up_proj", "down_proj") if c.hidden_act == "silu" else ("up_proj", "down_proj")
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        for p in pathways:
            q, k, v, o, nq, nk = _ATTN[p]
            keys += [f"{pre}self_attn.{name}.{leaf}" for name in (q, k, v, o) for leaf in bias]
            if p == "gen" or c.qk_norm_for_text:
                keys += [f"{pre}self_attn.{nq}.weight", f"{pre}self_attn.{nk}.weight"]
            ln_in, ln_post, m = _BLOCK[p]
            keys += [f"{pre}{ln_in}.weight", f"{pre}{ln_post}.weight"] + [f"{pre}{m}.{n}.weight" for n in mlp]
    if c.generator:
        keys += ["norm_moe_gen.weight", "proj_in.weight", "proj_in.bias", "proj_out.weight", "proj_out.bias",
                 "time_embedder.linear_1.weight", "time_embedder.linear_1.bias",
                 "time_embedder.linear_2.weight", "time_embedder.linear_2.bias"]
        if c.sound_gen:
            keys += ["audio_proj_in.weight", "audio_proj_in.bias", "audio_proj_out.weight", "audio_proj_out.bias",
                     "audio_modality_embed"]
        if c.action_gen:
            keys += [f"action_proj_{d}.{n}.weight" for d in ("in", "out") for n in ("fc", "bias")]
            keys.append("action_modality_embed")
    return keys


def state_dict_from_flat(sd: Mapping[str, torch.Tensor], config: Cosmos3Config) -> dict[str, torch.Tensor]:
    """Flat (diffusers-named) tensors -> :class:`Cosmos3Transformer` state dict."""
    c = config
    out: dict[str, torch.Tensor] = {}
    renames = {"norm_moe_gen.weight": "gen_norm.weight"}
    pathways = ("und", "gen") if c.generator else ("und",)
    for key, tensor in sd.items():
        if not key.startswith("layers."):
            out[renames.get(key, key)] = tensor
    leaves = ("weight", "bias") if c.attention_bias else ("weight",)
    for i in range(c.num_hidden_layers):
        src, dst = f"layers.{i}.", f"layers.{i}.pathways."
        for p in pathways:
            q, k, v, o, nq, nk = _ATTN[p]
            for leaf in leaves:
                out[f"{dst}{p}.qkv.{leaf}"] = torch.cat([sd[f"{src}self_attn.{n}.{leaf}"] for n in (q, k, v)])
                out[f"{dst}{p}.o_proj.{leaf}"] = sd[f"{src}self_attn.{o}.{leaf}"]
            if p == "gen" or c.qk_norm_for_text:
                out[f"{dst}{p}.q_norm.weight"] = sd[f"{src}self_attn.{nq}.weight"]
                out[f"{dst}{p}.k_norm.weight"] = sd[f"{src}self_attn.{nk}.weight"]
            ln_in, ln_post, m = _BLOCK[p]
            out[f"{dst}{p}.input_norm.weight"] = sd[f"{src}{ln_in}.weight"]
            out[f"{dst}{p}.post_norm.weight"] = sd[f"{src}{ln_post}.weight"]
            gate_up = ("gate_proj", "up_proj") if c.hidden_act == "silu" else ("up_proj",)
            out[f"{dst}{p}.mlp.gate_up.weight"] = torch.cat([sd[f"{src}{m}.{n}.weight"] for n in gate_up])
            out[f"{dst}{p}.mlp.down.weight"] = sd[f"{src}{m}.down_proj.weight"]
    return out


def load_transformer(
    folder: Path, config: Cosmos3Config, *, device: torch.device | str, dtype: torch.dtype, layout: str = "diffusers",
) -> Cosmos3Transformer:
    """Read ``folder`` (``layout`` "diffusers": ``transformer/``; "transformers": the unified
    checkpoint) into a :class:`Cosmos3Transformer` on ``device`` in ``dtype`` (the time
    embedder stays fp32). Missing or unexpected keys fail before any tensor is read."""
    check_float_dtype(dtype)
    single, index = (DIFFUSERS_WEIGHTS, DIFFUSERS_INDEX) if layout == "diffusers" else (TRANSFORMERS_WEIGHTS, TRANSFORMERS_INDEX)
    files = weight_files(folder, single, index, "Cosmos3 transformer")

    def dropped(flat: str) -> bool:
        return bool(_IGNORED.search(flat) or VISION_TOWER_KEYS.search(flat)
                    or (not config.generator and GENERATOR_KEYS.search(flat)))

    raw = stored_keys(files)
    present = {flat_name(k) for k in raw} - {k for k in (flat_name(r) for r in raw) if dropped(k)}
    expected = set(checkpoint_keys(config))
    check_keys(expected, present, str(folder), "pass a Cosmos3 checkpoint whose config describes its weights")
    tensors = read_tensors(files, cast_to(device, dtype, lambda key: bool(KEEP_FP32.search(key))),
                           skip=lambda key: dropped(flat_name(key)))
    sd = state_dict_from_flat({flat_name(k): v for k, v in tensors.items()}, config)
    with torch.device("meta"):
        model = Cosmos3Transformer(config)
    shapes = model.state_dict()
    assert set(shapes) == set(sd), f"key mapping out of sync with Cosmos3Transformer: {sorted(set(shapes) ^ set(sd))}"
    check_shapes(sd, shapes, str(folder))
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def read_config(folder: Path, layout: str = "diffusers") -> Cosmos3Config:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a Cosmos3 checkpoint folder")
    raw = json.loads(path.read_text())
    try:
        return Cosmos3Config.from_diffusers_config(raw) if layout == "diffusers" else Cosmos3Config.from_reasoner_config(raw)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: malformed Cosmos3 config ({e!r})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
