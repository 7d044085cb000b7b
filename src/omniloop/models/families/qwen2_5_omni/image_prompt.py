"""Images in a Qwen2.5-Omni conversation: image parts -> the checkpoint's image processor
(``Qwen2VLImageProcessor``: resized to multiples of 28 px within its pixel budget, cut into
14 px patches) -> the vision encoder -> embeddings that replace the prompt's ``<|IMAGE|>``
placeholders (each expanded to ``t * h * w / merge^2``, as ``Qwen2_5OmniProcessor`` does).

With an image the thinker's positions are 3-D (transformers' ``get_rope_index``): text and
audio advance one position per token on all three planes; an image of ``h x w`` merged cells
starting at ``p`` takes planes ``(p, p + i, p + j)`` and the next token continues at
``p + max(h, w)``. A generated token at context index ``k`` sits at ``k + delta`` on every
plane (``delta = max prompt position + 1 - prompt length``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omniloop.io.image import open_image
from omniloop.models.families.qwen2_5_omni.vision_encoder import OmniVisionEncoder
from omniloop.request import ImagePart, InvalidRequest, OmniRequest


@dataclass(frozen=True)
class ImageInput:
    """One image part, processed: ``pixels [N, C * T * P * P]`` and its patch grid ``(t, h, w)``."""

    part: int
    pixels: torch.Tensor
    grid: tuple[int, int, int]

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge**2


def image_parts(request: OmniRequest) -> list[tuple[int, ImagePart]]:
    return [(i, p) for i, p in enumerate(request.inputs) if isinstance(p, ImagePart)]


def process_image(index: int, part: ImagePart, processor: Any) -> ImageInput:
    """An image part through the checkpoint's image processor; an undecodable one is an
    InvalidRequest naming ``inputs[index]``."""
    field = f"inputs[{index}]"
    try:
        image = open_image(part.data if part.data is not None else part.raw_bytes() if part.b64 is not None else part.path)
    except (ValueError, OSError) as e:
        raise InvalidRequest(f"{field}: cannot decode the image ({e}); send a PNG, JPEG or WebP", fields=(field,)) from None
    out = processor(images=[image.convert("RGB")], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return ImageInput(part=index, pixels=out["pixel_values"], grid=(t, h, w))


def image_embeds(tower: OmniVisionEncoder, images: Sequence[ImageInput], device: torch.device,
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Each image's merged embeddings ``[tokens, D]`` (the tower run once over all of them)."""
    merge = tower.config.spatial_merge_size
    out = tower(torch.cat([im.pixels for im in images]).to(device), [im.grid for im in images]).to(dtype)
    return list(out.split([im.tokens(merge) for im in images]))


def rope_positions(ids: Sequence[int], image_token: int, grids: Sequence[tuple[int, int, int]], merge: int,
                   seconds_per_position: float = 25.0) -> tuple[torch.Tensor, int]:
    """``[3, len(ids)]`` multimodal positions of a prompt whose image runs are ``grids`` (in order),
    and the decode delta. A frame's temporal plane advances ``25`` per second (one image: 0)."""
    planes: list[torch.Tensor] = []
    pos, i, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            j = i
            while j < len(ids) and ids[j] != image_token:
                j += 1
            planes.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        t, h, w = grids[k]
        gh, gw = h // merge, w // merge
        tt = (torch.arange(t) * seconds_per_position).long().view(-1, 1).expand(-1, gh * gw).flatten()
        hh = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()
        block = torch.stack([tt, hh, ww]) + pos
        planes.append(block)
        pos = int(block.max()) + 1
        i += t * gh * gw
        k += 1
    assert k == len(grids), f"{len(grids)} images but {k} placeholder runs"
    positions = torch.cat(planes, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)
