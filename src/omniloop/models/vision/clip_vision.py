"""CLIP vision encoder (transformers ``CLIPVisionModel`` + ``CLIPImageProcessor``) as a
conditioning component, with diffusers' Wan2.1 I2V handling
(``WanImageToVideoPipeline.encode_image``): the processor resizes / center-crops /
normalizes the raw images, and the penultimate layer's hidden states are the image tokens.

Stateless per request: ``encode`` takes the images and returns their tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.base import WrappedModel


class CLIPVisionEncoder(WrappedModel):
    """``encode(images) -> [N, 1 + patches, hidden]`` (257 x 1280 for ViT-H/14 at 224 px)."""

    def __init__(self, model: torch.nn.Module, processor: Any) -> None:
        self.model = model
        self.processor = processor
        self.config: Any = model.config  # transformers' CLIPVisionConfig

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @torch.inference_mode()
    def encode(self, images: Sequence[Any], device: torch.device | str | None = None) -> torch.Tensor:
        """``images``: PIL images (or arrays the processor takes), any size. Returns the
        penultimate hidden states ``[N, L_img, hidden]`` (diffusers' ``hidden_states[-2]``)."""
        pixels = self.processor(images=list(images), return_tensors="pt").to(self.device)
        out = self.model(**pixels, output_hidden_states=True)
        hidden = out.hidden_states[-2]
        return hidden if device is None else hidden.to(device)


def load_clip_vision_encoder(encoder_dir: Path, processor_dir: Path, *, device: torch.device | str,
                             dtype: torch.dtype) -> CLIPVisionEncoder:
    """A diffusers folder's ``image_encoder/`` (CLIPVisionModel) and ``image_processor/``."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    for folder in (encoder_dir, processor_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model: torch.nn.Module = CLIPVisionModel.from_pretrained(encoder_dir, dtype=dtype)
    return CLIPVisionEncoder(model.to(device).eval(), CLIPImageProcessor.from_pretrained(processor_dir))


# -- ComfyUI's clip_vision/ single file ---------------------------------------------------------

# the normalization of every released CLIP vision encoder (OpenAI's), CLIPImageProcessor's default too
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RELEASED_HEADS = 16  # ViT-L/14, ViT-H/14 and ViT-bigG/14 all have 16 heads (not in the file)
QUICK_GELU_LAYERS = 24  # ViT-L/14 (OpenAI's) uses quick_gelu; ViT-H / bigG (open_clip) gelu
PREFIX = "vision_model."


def clip_vision_config(state: dict[str, torch.Tensor], num_attention_heads: int | None = None) -> Any:
    """The ``CLIPVisionConfig`` of a transformers-layout vision tower state (the layout of
    ComfyUI's ``clip_vision_h.safetensors``): widths, depth, patch and image size read off the
    tensors; the head count (not in the file) is the released 16 unless given."""
    from transformers import CLIPVisionConfig

    patch = state[f"{PREFIX}embeddings.patch_embedding.weight"]  # [hidden, 3, p, p]
    positions = state[f"{PREFIX}embeddings.position_embedding.weight"].shape[0]  # 1 + (image / p)^2
    side = round((positions - 1) ** 0.5)
    if side * side != positions - 1:
        raise ValueError(f"position_embedding has {positions} rows, not 1 + a square number of patches")
    layers = 1 + max(int(k[len(f"{PREFIX}encoder.layers."):].split(".", 1)[0]) for k in state
                     if k.startswith(f"{PREFIX}encoder.layers."))
    hidden = int(patch.shape[0])
    if hidden % (num_attention_heads or RELEASED_HEADS):
        raise ValueError(f"width {hidden} does not split into {num_attention_heads or RELEASED_HEADS} heads; pass "
                         "the encoder's head count")
    return CLIPVisionConfig(
        hidden_size=hidden, intermediate_size=int(state[f"{PREFIX}encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=layers, num_attention_heads=num_attention_heads or RELEASED_HEADS,
        image_size=side * int(patch.shape[-1]), patch_size=int(patch.shape[-1]),
        hidden_act="quick_gelu" if layers == QUICK_GELU_LAYERS else "gelu", layer_norm_eps=1e-5,
    )


def load_clip_vision_single_file(path: Path, *, device: torch.device | str, dtype: torch.dtype,
                                 num_attention_heads: int | None = None) -> CLIPVisionEncoder:
    """ComfyUI's ``clip_vision/`` file (``CLIPVisionLoader``): a transformers
    ``CLIPVisionModelWithProjection`` state (``vision_model.*``, ``visual_projection.weight``,
    fp16 as released). The tower loads as ``CLIPVisionModel`` (the projection is unused: Wan
    reads the penultimate hidden state); the processor is CLIP's (resize the short side to
    the image size, center crop, OpenAI's mean and std)."""
    from safetensors.torch import load_file
    from transformers import CLIPImageProcessor, CLIPVisionModel

    state = load_file(str(path))
    if any(k.startswith("visual.transformer.") for k in state):
        raise ValueError(f"{Path(path).name}: an open_clip-layout file (visual.transformer.*) is not read; pass "
                         "ComfyUI's transformers-layout clip_vision file (vision_model.*), e.g. clip_vision_h.safetensors")
    if f"{PREFIX}embeddings.patch_embedding.weight" not in state:
        raise ValueError(f"{Path(path).name}: not a CLIP vision encoder (no {PREFIX}embeddings.patch_embedding.weight)")
    try:
        config = clip_vision_config(state, num_attention_heads)
    except ValueError as e:
        raise ValueError(f"{Path(path).name}: {e}") from None
    model = CLIPVisionModel(config).eval()
    unknown = sorted(k for k in state if not k.startswith(PREFIX) and k != "visual_projection.weight")
    if unknown:
        raise ValueError(f"{Path(path).name}: keys no CLIP vision tower has: {unknown[:5]}")
    # the file's keys are CLIPVisionModelWithProjection's (vision_model.*); CLIPVisionModel's may
    # drop that prefix (transformers 5)
    keep = next(iter(model.state_dict())).startswith(PREFIX)
    tower = {(k if keep else k[len(PREFIX):]): v.to(dtype) for k, v in state.items() if k.startswith(PREFIX)}
    model.load_state_dict(tower, strict=True)
    size = config.image_size
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                   image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD))
    return CLIPVisionEncoder(model.to(device=device, dtype=dtype), processor)
