"""Group-relative advantages (GRPO): each reward against its group's mean (and spread)."""

from __future__ import annotations

from typing import Sequence

import torch


def group_advantages(rewards: torch.Tensor, groups: Sequence[int], *, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """``rewards`` [N] -> advantages [N]: ``(r - mean_g) / (std_g + eps)`` within each group ``g``
    (population std, as Flow-GRPO's per-prompt stat tracker); ``scale_by_std=False``: ``r - mean_g``."""
    assert rewards.ndim == 1 and rewards.shape[0] == len(groups), f"{tuple(rewards.shape)} rewards for {len(groups)} groups"
    out = torch.empty_like(rewards, dtype=torch.float32)
    index = torch.tensor(list(groups))
    for g in index.unique().tolist():
        rows = index == g
        r = rewards[rows].float()
        centred = r - r.mean()
        out[rows] = centred / (r.std(unbiased=False) + eps) if scale_by_std else centred
    return out


def zero_variance(rewards: torch.Tensor, *, atol: float = 1e-8) -> bool:
    """A group whose rewards are all equal teaches nothing relative (its advantages are 0)."""
    return bool((rewards.max() - rewards.min()).abs() <= atol)


def clip_advantages(adv: torch.Tensor, max_abs: float) -> torch.Tensor:
    return adv.clamp(-max_abs, max_abs)
