"""Canny edge detection in torch, with the conventions of ComfyUI's ``Canny`` node (which runs
``kornia.filters.canny`` with its default 5x5, sigma-1 blur; tests/workflows/test_canny.py
holds kornia as the oracle): the edge map a FLUX.1 Canny model is conditioned on.

Steps, on an RGB image in [0, 1] (``[H, W, 3]``):
1. BT.601 luma (0.299, 0.587, 0.114);
2. a separable 5x5 Gaussian blur (sigma 1), the border reflected;
3. unnormalized Sobel gradients (a unit step reads 4), the border replicated;
   magnitude ``sqrt(gx^2 + gy^2 + eps)``;
4. non-maximum suppression along the gradient direction rounded to 45 degrees: a pixel must
   exceed both neighbours along it, ties kept on the right / lower side (OpenCV's rule) and
   never on a diagonal; outside the image the magnitude is that of a zero gradient;
5. thresholds (strict): weak above ``low``, strong above ``high``; hysteresis keeps the weak
   pixels 8-connected to strong ones, until nothing changes.
Returns ``[H, W]`` float32 edges of 0 and 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6
# direction k (the gradient angle rounded to k * 45 degrees) -> (dy, dx) of its neighbour
_NEIGHBOURS = ((0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1))
_TIES_KEPT = (0, 2)  # right and down: a tie with that neighbour keeps the pixel


def _gaussian_kernel(size: int = 5, sigma: float = 1.0) -> torch.Tensor:
    n = torch.arange(size, dtype=torch.float32) - size // 2
    k = torch.exp(-(n * n) / (2 * sigma * sigma))
    return k / k.sum()


def _blur(gray: torch.Tensor) -> torch.Tensor:
    """[1, 1, H, W] -> the same, blurred by the separable Gaussian (reflected border)."""
    k = _gaussian_kernel()
    r = k.numel() // 2
    x = F.pad(gray, (r, r, r, r), mode="reflect")
    x = F.conv2d(x, k.view(1, 1, 1, -1))  # along rows
    return F.conv2d(x, k.view(1, 1, -1, 1))  # along columns


def _sobel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 1, H, W] -> (gx, gy) [H, W], unnormalized, replicated border."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    kernels = torch.stack([kx, kx.t()])[:, None]  # [2, 1, 3, 3]
    g = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernels)[0]  # [2, H, W]
    return g[0], g[1]


def _suppress(gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """The magnitude where it is a ridge along its gradient direction, else 0 ([H, W])."""
    h, w = gx.shape
    padded = torch.sqrt(F.pad(gx, (1, 1, 1, 1)) ** 2 + F.pad(gy, (1, 1, 1, 1)) ** 2 + EPS)  # [H+2, W+2]
    magnitude = padded[1:1 + h, 1:1 + w]
    shifted = torch.stack([padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] for dy, dx in _NEIGHBOURS])  # [8, H, W]
    direction = (torch.nan_to_num(torch.atan2(gy, gx)) * (4 / torch.pi)).round()
    keep = magnitude > padded[0, 0]  # above a zero gradient's magnitude
    for k in (direction % 8, (direction + 4) % 8):
        k = k.long()
        other = shifted.gather(0, k[None])[0]
        ties = (k == _TIES_KEPT[0]) | (k == _TIES_KEPT[1])
        keep &= (magnitude > other) | (ties & (magnitude == other))
    return magnitude * keep


def _hysteresis(weak: torch.Tensor, strong: torch.Tensor) -> torch.Tensor:
    """Grow ``strong`` ([H, W] bool) through 8-connected ``weak`` pixels until it stops."""
    ring = torch.ones(1, 1, 3, 3)
    while True:
        touching = F.conv2d(strong[None, None].float(), ring, padding=1)[0, 0] > 0
        grown = strong | (weak & touching)
        if torch.equal(grown, strong):
            return strong
        strong = grown


def canny(image: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``image``: [H, W, 3] RGB in [0, 1] -> [H, W] float32 edges (0 / 1)."""
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"canny takes an [H, W, 3] RGB image; got {list(image.shape)}")
    if not 0 < low <= high:
        raise ValueError(f"canny thresholds must satisfy 0 < low_threshold <= high_threshold; got {low}, {high}")
    rgb = image.to(torch.float32)
    gray = (0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2])[None, None]  # [1, 1, H, W]
    gx, gy = _sobel(_blur(gray))
    magnitude = _suppress(gx, gy)
    return _hysteresis(magnitude > low, magnitude > high).to(torch.float32)
