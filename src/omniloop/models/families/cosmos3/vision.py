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

import numpy as np
import torch

from omniloop.models.checkpoint_files import cast_to, read_tensors, stored_keys, weight_files
from omniloop.models.layers.vision_patches import resize_frames, video_patches
from omniloop.models.vision.qwen3_vit import assign_vit
from omniloop.pipeline.loops.ar import PromptTokens

VIT_KEYS = re.compile(r"^(?:model\.visual\.)?((?:blocks|merger|patch_embed|pos_embed|deepstack_merger_list)\..*)$")
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


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
    tensors = read_tensors(files, cast_to(device, dtype, lambda key: False), skip=lambda key: not VIT_KEYS.match(key))
    state = {VIT_KEYS.match(k).group(1): v for k, v in tensors.items()}  # type: ignore[union-attr]
    return assign_vit(Qwen3VLVisionModel, Qwen3VLVisionConfig, raw, state, folder, device)


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


@dataclass(frozen=True)
class VideoProcessing:
    """Qwen3-VL's video preprocessing (``video_preprocessor_config.json``; the defaults are
    ``Qwen3VLVideoProcessor``'s): frames sampled at ``fps``, resized so ``T*H*W`` pixels fall
    in ``[min_pixels, max_pixels]`` (multiples of ``patch_size * merge_size``), normalized,
    cut into ``temporal_patch_size x patch_size^2`` patches."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    sample_frames: bool = True
    cap_pixels_per_frame: bool = False  # qwen-vl-utils' per-frame budget (transformers: off unless set)
    max_video_tokens: int = 768  # the per-frame cap, in merged tokens

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "VideoProcessing":
        size = raw.get("size") or {}
        known = {k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "fps", "min_frames",
                                     "max_frames", "rescale_factor", "max_video_tokens") if raw.get(k) is not None}
        return cls(**known, min_pixels=size.get("shortest_edge", cls.min_pixels),
                   max_pixels=size.get("longest_edge", cls.max_pixels),
                   mean=tuple(raw.get("image_mean", cls.mean)), std=tuple(raw.get("image_std", cls.std)),
                   sample_frames=raw.get("do_sample_frames", True),
                   cap_pixels_per_frame=bool(raw.get("cap_pixels_per_frame") or False))


def load_video_processing(folder: Path) -> VideoProcessing | None:
    path = folder / "video_preprocessor_config.json"
    return VideoProcessing.from_config(json.loads(path.read_text())) if path.is_file() else None


@dataclass
class Media:
    """One image or video of a prompt, cut into ViT patches."""

    kind: str  # "image" | "video"
    pixels: torch.Tensor  # [N, C * temporal_patch * patch^2] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch group

    def placeholder(self, merge: int) -> str:
        """What the prompt's media slot becomes (``Qwen3VLProcessor.replace_*_token``)."""
        t, h, w = self.grid
        per_frame = h * w // merge**2
        if self.kind == "image":
            return IMAGE_PAD * (t * per_frame)
        return "".join(f"<{ts:.1f} seconds>{VISION_START}{VIDEO_PAD * per_frame}{VISION_END}" for ts in self.timestamps)

    def runs(self) -> list[tuple[int, int]]:
        """(h, w) patch grid of each run of pad tokens it leaves in the prompt (a video: one per frame group)."""
        t, h, w = self.grid
        return [(h, w)] if self.kind == "image" else [(h, w)] * t


def image_media(processor, image) -> Media:
    batch = processor(images=[image], return_tensors="pt")
    return Media("image", batch["pixel_values"], tuple(int(v) for v in batch["image_grid_thw"][0]))  # type: ignore[arg-type]


def _video_size(cfg: VideoProcessing, frames: int, height: int, width: int) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize`` (``video_processing_qwen3_vl.py``), with the per-frame
    cap of ``Qwen3VLVideoProcessor.resize`` when the config turns it on."""
    import math

    factor = cfg.patch_size * cfg.merge_size
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * factor * factor, cfg.max_pixels // frames), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video prompt's frames are {height}x{width}: the aspect ratio must be under 200; "
                         "pass frames closer to square")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / cfg.temporal_patch_size) * cfg.temporal_patch_size
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def sample_indices(cfg: VideoProcessing, total: int, fps: float) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames``: ``n`` frames at ``cfg.fps`` (within
    ``[min_frames, max_frames]`` and the clip), spread evenly; numpy's float64 linspace and
    round-half-even, as there (torch's float32 linspace rounds some ``.5`` indices otherwise)."""
    if not cfg.sample_frames:
        return list(range(total))
    n = min(max(int(total / fps * cfg.fps), cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def video_media(cfg: VideoProcessing, frames: torch.Tensor, fps: float) -> Media:
    """``frames [F, H, W, 3]`` uint8 at ``fps`` -> patches (``Qwen3VLVideoProcessor``: frame
    sampling, resize, fused rescale + normalize, pad to whole temporal patches, patchify) and
    the frame groups' timestamps (``Qwen3VLProcessor._calculate_timestamps``). Equal to
    transformers' ``pixel_values_videos`` bit for bit (tests/models/cosmos3/test_video_processor_parity.py)."""
    index = sample_indices(cfg, frames.shape[0], fps)
    if len(index) < cfg.temporal_patch_size:
        raise ValueError(f"a video prompt needs at least {cfg.temporal_patch_size} frames, got {len(index)}")
    video = frames[index].permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    h, w = _video_size(cfg, len(index), video.shape[2], video.shape[3])
    pixels, grid = video_patches(resize_frames(video, h, w), mean=cfg.mean, std=cfg.std, rescale_factor=cfg.rescale_factor,
                                 temporal_patch=cfg.temporal_patch_size, patch=cfg.patch_size, merge=cfg.merge_size)
    tp = cfg.temporal_patch_size
    # a group's time: the mean of its first and last frame's (the last index repeats to fill it)
    padded = index + [index[-1]] * (-len(index) % tp)
    stamps = tuple((padded[i] / fps + padded[i + tp - 1] / fps) / 2 for i in range(0, len(padded), tp))
    return Media("video", pixels, grid, stamps)


VIDEO_SLOT = f"{VISION_START}{VIDEO_PAD}{VISION_END}"  # what the chat template renders for a video
_MEDIA_SLOTS = re.compile(f"({re.escape(VIDEO_SLOT)}|{re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)})")


def expand_pads(text: str, media: Sequence[Media], merge: int) -> str:
    """Each media slot of the rendered template (one per media part, in order) -> its
    placeholder. A video's whole ``<|vision_start|><|video_pad|><|vision_end|>`` becomes its
    per-frame ``<t seconds><|vision_start|>pads<|vision_end|>`` run, as upstream Qwen3-VL and
    transformers >= 5.25 do (a bare ``<|video_pad|>`` too); an image's pad alone is replaced."""
    out, k = [], 0
    for piece in _MEDIA_SLOTS.split(text):
        if piece in (IMAGE_PAD, VIDEO_PAD, VIDEO_SLOT):
            assert k < len(media) and (piece == IMAGE_PAD) == (media[k].kind == "image"), \
                "the prompt's media pads do not follow its media parts"
            out.append(media[k].placeholder(merge))
            k += 1
        else:
            out.append(piece)
    assert k == len(media), f"{len(media)} media parts but {k} pads in the prompt"
    return "".join(out)


def rope_positions(ids: Sequence[int], pad_ids: set[int], runs: Sequence[tuple[int, int]], merge: int
                   ) -> tuple[torch.Tensor, int]:
    """Qwen3-VL's ``get_rope_index`` for one prompt: ``positions [3, L]`` and the decode delta.
    ``runs``: the ``(h, w)`` patch grid of each run of pad tokens, in order."""
    planes, pos, k, i = [], 0, 0, 0
    while i < len(ids):
        if ids[i] not in pad_ids:
            j = i
            while j < len(ids) and ids[j] not in pad_ids:
                j += 1
            planes.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        gh, gw = runs[k]
        h, w = gh // merge, gw // merge
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        planes.append(torch.stack([torch.full((h * w,), pos), hh.flatten() + pos, ww.flatten() + pos]))
        pos += max(h, w)
        i += h * w
        k += 1
    assert k == len(runs), f"{len(runs)} media runs but {k} in the prompt"
    positions = torch.cat(planes, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)


@torch.inference_mode()
def vision_prompt(tower, tokenizer, text: str, media: Sequence[Media], device: torch.device,
                  dtype: torch.dtype) -> VisionPromptTokens:
    """The rendered chat template (one pad per media part) + the media -> the expanded prompt
    ids and its :class:`VisionPrompt` (the ViT run once per image / video)."""
    merge = tower.spatial_merge_size
    ids = list(tokenizer(expand_pads(text, media, merge), add_special_tokens=False)["input_ids"])
    embeds, deep = [], []
    for m in media:
        out = tower(m.pixels.to(device, dtype), grid_thw=torch.tensor([m.grid], device=device), return_dict=True)
        embeds.append(out.pooler_output.to(dtype))
        deep.append([f.to(dtype) for f in out.deepstack_features])
    pad_ids = {tokenizer.convert_tokens_to_ids(IMAGE_PAD), tokenizer.convert_tokens_to_ids(VIDEO_PAD)}
    positions, delta = rope_positions(ids, pad_ids, [r for m in media for r in m.runs()], merge)
    is_visual = torch.tensor([t in pad_ids for t in ids])
    visual_index = torch.full((len(ids),), -1, dtype=torch.long)
    visual_index[is_visual] = torch.arange(int(is_visual.sum()))
    prompt = VisionPrompt(positions=positions.to(device), delta=delta, visual_index=visual_index.to(device),
                          embeds=torch.cat(embeds), deepstack=[torch.cat(layer) for layer in zip(*deep)])
    assert prompt.embeds.shape[0] == int(is_visual.sum()), "visual embeddings and pad tokens disagree"
    return VisionPromptTokens(token_ids=ids, lm_inputs=prompt)


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
