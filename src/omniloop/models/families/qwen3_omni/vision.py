"""Qwen3-Omni's vision input: images in a conversation through the thinker's ViT
(``thinker.visual.*``: ``patch_embed`` / ``pos_embed`` / ``blocks`` / ``merger`` / ``merger_list``).

The ViT is transformers' ``Qwen3OmniMoeVisionEncoder`` (Qwen3-VL's, with DeepStack) run as a
component, as Cosmos3's reasoner runs its Qwen3-VL ViT: pixels -> merged embeddings ``[Nv, D]``
(one per 2x2 patch group) plus DeepStack features, one ``[Nv, D]`` per early thinker layer.
The processor's ``<|image_pad|>`` is expanded to ``Nv`` placeholders; their embeddings replace
the placeholders' and the DeepStack features are added to the thinker's hidden states after its
first layers (``MediaEmbeds.add_deepstack``); positions are the 3-D multimodal ones
(``omniloop.models.omni.image_prompt.rope_positions``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.checkpoint_files import cast_to, read_tensors, stored_keys, weight_files
from omniloop.models.vision.qwen3_vit import assign_vit

VISION_PREFIX = "thinker.visual."


def load_vision_tower(folder: Path, *, device: torch.device | str, dtype: torch.dtype) -> Any:
    """The thinker's ViT as a ``Qwen3OmniMoeVisionEncoder``, or None when the checkpoint holds none
    of its tensors (then images are refused at admission)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    files = weight_files(folder, "model.safetensors", "model.safetensors.index.json", "Qwen3OmniMoeForConditionalGeneration")
    if not any(k.startswith(VISION_PREFIX) for k in stored_keys(files)):
        return None
    raw = json.loads((folder / "config.json").read_text())["thinker_config"].get("vision_config")
    if not isinstance(raw, dict):
        raise ValueError(f"{folder / 'config.json'}: the checkpoint holds thinker.visual.* weights but no "
                         "thinker_config.vision_config; pass a folder whose config describes its vision tower")
    tensors = read_tensors(files, cast_to(device, dtype, lambda key: False), skip=lambda key: not key.startswith(VISION_PREFIX))
    state = {k[len(VISION_PREFIX):]: v for k, v in tensors.items()}
    return assign_vit(Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeVisionEncoderConfig, raw, state, folder, device)


def image_embeds(tower: Any, pixels: Sequence[torch.Tensor], grids: Sequence[tuple[int, int, int]],
                 device: torch.device, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each image's merged embeddings ``[tokens, D]`` and every image's DeepStack features
    ``[layers, sum(tokens), D]`` (the ViT run once over all of them, as ``get_image_features``)."""
    out = tower(torch.cat(list(pixels)).to(device, tower.dtype), grid_thw=torch.tensor(list(grids), device=device))
    merge = tower.config.spatial_merge_size
    embeds = out.pooler_output.to(dtype)  # [sum(tokens), D]
    deepstack = torch.stack([f.to(dtype) for f in out.deepstack_features])  # [layers, sum(tokens), D]
    return list(embeds.split([t * h * w // merge**2 for t, h, w in grids])), deepstack
