"""The control image a compiled request carries (``ImagePart(role='control')``): the
LoadImage file, scaled where a scale node sized it, its Canny edge map where a Canny node
made one, center-cropped to the canvas as ComfyUI's InstructPixToPixConditioning crops it
(offsets ``(size - canvas) // 2``: ComfyUI's ``(size % 8) // 2`` wherever the canvas is its crop)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from omniloop.request import ImagePart
from omniloop.workflows.values import Pixels


def control_part(pixels: Pixels, width: int | None, height: int | None) -> ImagePart:
    import numpy as np
    import torch
    from PIL import Image

    from omniloop.workflows.canny import canny

    assert pixels.path is not None, "InstructPixToPixConditioning checks the control image is a file's"
    if not Path(pixels.path).is_file():  # compiled without an input folder: a stand-in
        return ImagePart(path=pixels.path, role="control")
    with Image.open(pixels.path) as opened:
        image = opened.convert("RGB")
    if pixels.width is not None and pixels.height is not None and image.size != (pixels.width, pixels.height):
        image = image.resize((pixels.width, pixels.height), resample=Image.Resampling.LANCZOS)
    rgb = np.asarray(image)
    if pixels.canny is not None:  # ComfyUI's IMAGE: RGB in [0, 1]; the edges 0 / 1 on all three channels
        edges = canny(torch.from_numpy(rgb.astype(np.float32) / 255.0), *pixels.canny)
        rgb = np.repeat((edges.numpy() * 255).astype(np.uint8)[..., None], 3, axis=2)
    h, w = rgb.shape[:2]
    if width is not None and height is not None and width <= w and height <= h:  # (else the model resizes it)
        top, left = (h - height) // 2, (w - width) // 2
        rgb = rgb[top:top + height, left:left + width]
    return _png(np.ascontiguousarray(rgb))


def _png(rgb) -> ImagePart:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role="control")
