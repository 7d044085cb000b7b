"""Images: loading conditioning images from any source, and PNG writing."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch


def open_image(source: Any) -> "PIL.Image.Image":  # noqa: F821
    """A PIL RGB image from a path, bytes, PIL image, [H, W, 3] uint8 array or tensor.

    Unreadable input raises ValueError naming the source.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, torch.Tensor):
        source = source.detach().cpu().numpy()
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] != 3 or source.dtype != np.uint8:
            raise ValueError(f"image arrays must be [H, W, 3] uint8, got {source.shape} {source.dtype}")
        return Image.fromarray(source)
    label = str(source) if isinstance(source, (str, Path)) else "<bytes>"
    try:
        data = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else Path(source)
        img = Image.open(data)
        img.load()
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise ValueError(f"cannot read image {label}: {e}") from None
    return img.convert("RGB")


def open_image_part(part: Any) -> "PIL.Image.Image":  # noqa: F821
    """The PIL image of a request's ImagePart (in-process data, base64 bytes or a path)."""
    if part.data is not None:
        return open_image(part.data)
    if part.b64 is not None:
        return open_image(part.raw_bytes())
    return open_image(part.path)


def image_to_tensor(image: "PIL.Image.Image", height: int, width: int) -> torch.Tensor:  # noqa: F821
    """[1, 3, H, W] float32 in [-1, 1], resized (Lanczos, as diffusers) to height x width."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    arr = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # [H, W, 3]
    return (arr.permute(2, 0, 1)[None] * 2.0 - 1.0).contiguous()


def write_png(image: torch.Tensor | np.ndarray, dest: str | Path | io.BytesIO) -> None:
    from PIL import Image

    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"image must be [H, W, 3] uint8, got {arr.shape} {arr.dtype}")
    Image.fromarray(arr).save(dest, format="PNG")
