"""Frames -> the flattened ViT patches transformers' Qwen-VL video processors make
(``Qwen2VLVideoProcessor`` for Qwen2.5-Omni, ``Qwen3VLVideoProcessor`` for Cosmos3's reasoner):
the resize, the fused rescale + normalize, the temporal padding and the patchify they share.
Each family keeps its own frame sampling and size rule (``smart_resize`` differs between them)."""

from __future__ import annotations

from typing import Sequence

import torch


def resize_frames(video: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``video [T, 3, H, W]`` uint8 -> ``[T, 3, h, w]`` uint8, exactly as transformers'
    torchvision backend resizes it on CPU (``tvF.resize(BICUBIC, antialias=True)``; torchvision
    0.28's ``resize_image`` keeps uint8 for bicubic on CPU and calls ``interpolate`` on it, i.e.
    torch's fixed-point uint8 antialiased kernel, not float-then-round). Unchanged when the
    size already matches (torchvision returns its input then)."""
    if (h, w) == tuple(video.shape[-2:]):
        return video
    return torch.nn.functional.interpolate(video.contiguous(), size=[h, w], mode="bicubic", align_corners=False,
                                           antialias=True)


def video_patches(video: torch.Tensor, *, mean: Sequence[float], std: Sequence[float], rescale_factor: float,
                  temporal_patch: int, patch: int, merge: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``video [T, 3, h, w]`` uint8 (resized: ``h``, ``w`` multiples of ``patch * merge``) ->
    ``pixels [gt * gh * gw, 3 * temporal_patch * patch^2]`` float32 and the grid ``(gt, gh, gw)``:
    rescale fused into normalize (``(x - mean / r) / (std / r)``, transformers' order), the last
    frame repeated to fill a temporal patch, patches ordered merge cell by merge cell."""
    m = torch.tensor(list(mean)) * (1.0 / rescale_factor)
    s = torch.tensor(list(std)) * (1.0 / rescale_factor)
    x = video.to(torch.float32).sub_(m.view(3, 1, 1)).div_(s.view(3, 1, 1))
    if pad := -x.shape[0] % temporal_patch:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    h, w = x.shape[-2:]
    gt, gh, gw = x.shape[0] // temporal_patch, h // patch, w // patch
    cells = x.view(gt, temporal_patch, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    pixels = cells.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * temporal_patch * patch * patch)
    return pixels, (gt, gh, gw)
