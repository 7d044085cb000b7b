"""The reasoner's vision input: images in a Cosmos3 conversation (the unified checkpoint's
Qwen3-VL ViT, ``blocks.*`` / ``merger.*`` / ``patch_embed.*`` / ``pos_embed.*`` /
``deepstack_merger_list.*``).

The ViT is transformers' ``Qwen3VLVisionModel`` run as a component (like the text encoders
of other families): pixels -> merged visual embeddings ``[Nv, D]`` (one per 2x2 patch group)
plus DeepStack features, one ``[Nv, D]`` per early LM layer. The prompt's
``<|image_pad|>`` is expanded to ``Nv`` tokens (as ``Qwen3VLProcessor`` does); their
embeddings replace the pad tokens' and the DeepStack features are added to the hidden
states after the first layers (``Qwen3VLTextModel._deepstack_process``). Positions are
Qwen3-VL's 3D-MRoPE: text advances one position per token on all three planes, an image
of ``h x w`` merged patches takes planes ``(p, p + i, p + j)`` and advances ``max(h, w)``;
decode positions are ``index + delta`` (``delta = max position + 1 - prompt length``).

Everything per request lives on :class:`VisionPrompt` (the prompt artifact); the ViT holds
no request state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.checkpoint_files import cast_to, read_tensors, stored_keys, weight_files
from omniloop.pipeline.loops.ar import PromptTokens

VIT_KEYS = re.compile(r"^(?:model\.visual\.)?((?:blocks|merger|patch_embed|pos_embed|deepstack_merger_list)\..*)$")
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


# -- loading -------------------------------------------------------------------------------


def load_vision_tower(folder: Path, *, device: torch.device | str, dtype: torch.dtype):
    """The unified checkpoint's ViT as a ``Qwen3VLVisionModel`` (None when the checkpoint has
    none: then the reasoner takes text only)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    files = weight_files(folder, "model.safetensors", "model.safetensors.index.json", "Cosmos3 unified checkpoint")
    if not any(VIT_KEYS.match(k) for k in stored_keys(files)):
        return None
    raw = json.loads((folder / "config.json").read_text()).get("vision_config")
    if not isinstance(raw, dict):
        raise ValueError(f"{folder / 'config.json'}: the checkpoint holds ViT weights but no vision_config; pass a "
                         "unified Cosmos3 checkpoint whose config describes its vision tower")
    config = Qwen3VLVisionConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    tensors = read_tensors(files, cast_to(device, dtype, lambda key: False), skip=lambda key: not VIT_KEYS.match(key))
    state = {VIT_KEYS.match(k).group(1): v for k, v in tensors.items()}  # type: ignore[union-attr]
    with torch.device("meta"):
        tower = Qwen3VLVisionModel._from_config(config)
    missing = sorted(set(tower.state_dict()) - set(state))
    unexpected = sorted(set(state) - set(tower.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{folder}: the ViT weights do not match vision_config (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}); pass a checkpoint whose config describes its weights")
    tower.load_state_dict(state, strict=True, assign=True)
    # the non-persistent rotary buffers were built on meta: rebuild them (the class's own formula)
    rotary = tower.rotary_pos_emb
    inv_freq, _ = rotary.compute_axial_rope_parameters(config, device=device)
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
    assert not any(b.is_meta for b in tower.buffers()), "a ViT buffer is still on meta"
    return tower.eval().requires_grad_(False)


def load_image_processor(folder: Path):
    """The checkpoint's image processor (``preprocessor_config.json``), or None."""
    if not (folder / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(folder))


# -- per-request prompt ----------------------------------------------------------------------


@dataclass(kw_only=True)
class VisionPrompt:
    """What the reasoner's forwards need beyond the token ids of one request."""

    positions: torch.Tensor  # [3, L] long: MRoPE planes of the L prompt tokens
    delta: int  # decode position = context index + delta
    visual_index: torch.Tensor  # [L] long: row of ``embeds`` for a visual token, -1 for text
    embeds: torch.Tensor  # [Nv, D] merged visual embeddings, model dtype, on the device
    deepstack: list[torch.Tensor]  # per early layer, [Nv, D]

    @property
    def length(self) -> int:
        return self.visual_index.numel()


@dataclass(kw_only=True)
class VisionPromptTokens(PromptTokens):
    """Prompt ids with their images' tokens expanded, and the rows' vision inputs."""

    lm_inputs: VisionPrompt


def expand_image_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """Each ``pad_id`` (one per image, in order) -> ``counts[i]`` copies (Qwen3VLProcessor's
    replacement)."""
    out, k = [], 0
    for t in ids:
        if t == pad_id:
            assert k < len(counts), "more image pads in the prompt than images"
            out += [pad_id] * counts[k]
            k += 1
        else:
            out.append(t)
    assert k == len(counts), f"{len(counts)} images but {k} image pads in the prompt"
    return out


def rope_positions(ids: Sequence[int], pad_id: int, grids: Sequence[tuple[int, int, int]], merge: int
                   ) -> tuple[torch.Tensor, int]:
    """Qwen3-VL's ``get_rope_index`` for one prompt of images: ``positions [3, L]``, delta."""
    planes, pos, k, i = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != pad_id:
            j = i
            while j < len(ids) and ids[j] != pad_id:
                j += 1
            planes.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        _, gh, gw = grids[k]
        h, w = gh // merge, gw // merge
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        planes.append(torch.stack([torch.full((h * w,), pos), hh.flatten() + pos, ww.flatten() + pos]))
        pos += max(h, w)
        i += h * w
        k += 1
    positions = torch.cat(planes, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)


@torch.inference_mode()
def vision_prompt(tower, processor, tokenizer, ids: list[int], images: Sequence[Any], device: torch.device,
                  dtype: torch.dtype) -> VisionPromptTokens:
    """Chat-template ids (one ``<|image_pad|>`` per image) + the images -> the expanded
    prompt and its :class:`VisionPrompt`."""
    batch = processor(images=list(images), return_tensors="pt")
    grids = [tuple(int(v) for v in g) for g in batch["image_grid_thw"]]
    merge = tower.spatial_merge_size
    counts = [t * h * w // merge**2 for t, h, w in grids]
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    expanded = expand_image_pads(ids, pad_id, counts)
    out = tower(batch["pixel_values"].to(device, dtype), grid_thw=batch["image_grid_thw"].to(device), return_dict=True)
    positions, delta = rope_positions(expanded, pad_id, grids, merge)
    is_visual = torch.tensor(expanded) == pad_id
    visual_index = torch.full((len(expanded),), -1, dtype=torch.long)
    visual_index[is_visual] = torch.arange(int(is_visual.sum()))
    prompt = VisionPrompt(positions=positions.to(device), delta=delta, visual_index=visual_index.to(device),
                          embeds=out.pooler_output.to(dtype), deepstack=[f.to(dtype) for f in out.deepstack_features])
    return VisionPromptTokens(token_ids=expanded, lm_inputs=prompt)


# -- the forward's view ----------------------------------------------------------------------


@dataclass
class VisualRows:
    """Visual tokens of one forward: ``mask [B, Lq]`` (True = a visual token), the
    embeddings replacing theirs ``[Nv', D]`` and the DeepStack additions (row-major order)."""

    mask: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def forward_inputs(prompts: Sequence[VisionPrompt | None], context: torch.Tensor
                   ) -> tuple[torch.Tensor, VisualRows | None]:
    """``context [B, Lq]`` (each new token's context index) -> MRoPE ``positions [3, B, Lq]``
    and the visual rows (None when no token of this forward is visual)."""
    planes, masks, embeds, deep = [], [], [], []
    for vp, idx in zip(prompts, context):
        if vp is None:
            planes.append(idx.expand(3, -1))
            masks.append(torch.zeros_like(idx, dtype=torch.bool))
            continue
        inside = idx < vp.length
        clamped = idx.clamp(max=vp.length - 1)
        planes.append(torch.where(inside, vp.positions[:, clamped], idx + vp.delta))
        rows = torch.where(inside, vp.visual_index[clamped], -1)
        mask = rows >= 0
        masks.append(mask)
        embeds.append(vp.embeds[rows[mask]])
        deep.append([d[rows[mask]] for d in vp.deepstack])
    positions = torch.stack(planes, dim=1)  # [3, B, Lq]
    mask = torch.stack(masks)
    if not bool(mask.any()):
        return positions, None
    layers = max(len(d) for d in deep)
    return positions, VisualRows(mask, torch.cat(embeds), [torch.cat([d[i] for d in deep]) for i in range(layers)])
