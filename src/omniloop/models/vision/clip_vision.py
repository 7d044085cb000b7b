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

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def num_tokens(self) -> int:
        """Image tokens per image: the class token plus one per patch."""
        cfg = self.model.config
        return (cfg.image_size // cfg.patch_size) ** 2 + 1

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
    model = CLIPVisionModel.from_pretrained(encoder_dir, dtype=dtype).to(device).eval()
    return CLIPVisionEncoder(model, CLIPImageProcessor.from_pretrained(processor_dir))
