"""A transformers Qwen3-VL-style ViT (``Qwen3VLVisionModel``, Qwen3-Omni's
``Qwen3OmniMoeVisionEncoder``: patch embed, learned positions, blocks, merger, DeepStack
mergers) run as a component: built on ``meta`` from the checkpoint's ``vision_config`` and
assigned the checkpoint's tensors, each family reading them under its own prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch


def assign_vit(tower_class: Any, config_class: Any, vision_config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
               folder: Path, device: torch.device | str) -> Any:
    """``tower_class`` built from ``vision_config`` (``config_class``'s keys) with ``state`` (its own
    names, on ``device``); the key sets must match. Its non-persistent rotary buffers were built on
    meta: they are rebuilt by the class's own formula."""
    config = config_class(**{k: v for k, v in vision_config.items() if k != "model_type"})
    with torch.device("meta"):
        tower = tower_class._from_config(config)
    missing, unexpected = sorted(set(tower.state_dict()) - set(state)), sorted(set(state) - set(tower.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{folder}: the ViT weights do not match vision_config (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}); pass a checkpoint whose config describes its weights")
    tower.load_state_dict(dict(state), strict=True, assign=True)
    rotary = tower.rotary_pos_emb
    inv_freq, _ = rotary.compute_axial_rope_parameters(config, device=device)
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
    assert not any(b.is_meta for b in tower.buffers()), "a ViT buffer is still on meta"
    return tower.eval().requires_grad_(False)
