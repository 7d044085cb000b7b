"""Writing a FARDiT as a diffusers-format folder (``config.json`` + safetensors): the inverse
of ``models/families/far/weights.py``, through the Wan mapping its blocks share.

An action-conditioned model adds one key diffusers does not know, ``action_embedder.weight``
[A, D], and ``action_vocab`` in its config (omniloop's extension of the layout).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from omniloop.models.families.far.model import FARDiT, keeps_fp32
from omniloop.models.families.far.weights import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from omniloop.train.recipes.wan_checkpoint import dit_state_dict_to_diffusers

CLASS_NAME = "AnyFlowFARTransformer3DModel"


def far_state_dict_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    delta = {f"condition_embedder.{k}": v for k, v in sd.items() if k.startswith("delta_embedder.")}
    rest = {k: v for k, v in sd.items() if not k.startswith("delta_embedder.")}
    return {**dit_state_dict_to_diffusers(rest), **delta}


def far_config_dict(model: FARDiT) -> dict:
    cfg = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(model.config)}
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    if cfg.get("action_vocab") is None:
        cfg.pop("action_vocab", None)  # a plain FAR checkpoint stays a diffusers config
    return {"_class_name": CLASS_NAME, **cfg}


def save_far_dit(model: FARDiT, folder: Path, *, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` into ``folder``: floats in ``dtype`` except what the loader keeps fp32.
    ``max_shard_bytes``: above it, diffusers' sharded layout (``-0000i-of-0000n`` files and
    ``WEIGHTS_INDEX_FILE``; the device tool returns files of at most 16 MiB)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {}
    for key, tensor in far_state_dict_to_diffusers(model.state_dict()).items():
        t = tensor.detach().cpu()
        if t.is_floating_point():
            t = t.to(torch.float32 if keeps_fp32(key) else dtype)
        sd[key] = t.contiguous()
    shards = _shards(sd, max_shard_bytes)
    for old in [*folder.glob("diffusion_pytorch_model*.safetensors"), folder / WEIGHTS_INDEX_FILE]:
        old.unlink(missing_ok=True)
    names = [WEIGHTS_FILE] if len(shards) == 1 else [
        WEIGHTS_FILE.replace(".safetensors", f"-{i + 1:05d}-of-{len(shards):05d}.safetensors") for i in range(len(shards))]
    for name, part in zip(names, shards):
        tmp = folder / f".{name}.tmp"
        save_file(part, str(tmp))
        os.replace(tmp, folder / name)
    if len(shards) > 1:
        weight_map = {k: name for name, part in zip(names, shards) for k in part}
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (folder / WEIGHTS_INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                             "weight_map": weight_map}, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(far_config_dict(model), indent=2) + "\n")
    return folder


def _shards(sd: dict[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    """Tensors in key order, a new shard whenever the next one would pass ``limit`` bytes."""
    if limit is None:
        return [sd]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(sd):
        n = sd[key].numel() * sd[key].element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][key] = sd[key]
        size += n
    return shards
