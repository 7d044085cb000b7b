"""Media bytes for Dynamo responses: JPEG frames for ``/v1/videos/stream`` (the frontend
writes each as one ``multipart/x-mixed-replace`` part), PNG images, and progress frames
rendered from the partial latents the denoise loop emits while a request streams."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

JPEG_QUALITY = 85


def _uint8_rgb(image: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    assert arr.ndim == 3 and arr.shape[-1] == 3 and arr.dtype == np.uint8, f"need [H, W, 3] uint8, got {arr.shape} {arr.dtype}"
    return np.ascontiguousarray(arr)


def jpeg_b64(image: torch.Tensor | np.ndarray, quality: int = JPEG_QUALITY) -> str:
    """[H, W, 3] uint8 -> base64 JPEG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_uint8_rgb(image)).save(buf, format="JPEG", quality=quality)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def png_b64(image: torch.Tensor | np.ndarray) -> str:
    from omniloop.io.image import write_png

    buf = io.BytesIO()
    write_png(_uint8_rgb(image), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def latent_preview(latents: torch.Tensor, height: int, width: int) -> np.ndarray:
    """A coarse RGB picture of partial latents: the middle latent frame's first three
    channels, each stretched to [0, 255], resized to the requested ``height x width``.

    NOTE: a progress frame, not a decode: it shows where structure is forming at no VAE
    cost (a decode per step would cost more than the step). ``latents`` is
    [B, C, F, h, w] (video) or [B, C, h, w] (image).
    """
    from PIL import Image

    x = latents.detach().float().cpu()[0]  # [C, F, h, w] or [C, h, w]
    if x.ndim == 4:
        x = x[:, x.shape[1] // 2]  # [C, h, w]
    rgb = x[:3] if x.shape[0] >= 3 else x[:1].expand(3, -1, -1)  # [3, h, w]
    lo = rgb.amin(dim=(1, 2), keepdim=True)
    hi = rgb.amax(dim=(1, 2), keepdim=True)
    rgb = ((rgb - lo) / (hi - lo).clamp_min(1e-6) * 255.0).round().to(torch.uint8)
    small = Image.fromarray(rgb.permute(1, 2, 0).numpy())
    return np.asarray(small.resize((width, height), resample=Image.Resampling.BILINEAR))
