"""Conditioning injectors for the ``prepare_inputs`` and ``post_step`` slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omniloop.pipeline.edges import ConditionLatents


@dataclass(frozen=True)
class NoConditioning:
    name: str = "conditioning"
    input_port: str | None = None

    def init(self, condition: Any) -> Any:
        return None

    def prepare(self, latents: dict[str, torch.Tensor], state: Any) -> dict[str, torch.Tensor]:
        return latents

    def post_step(self, latents: dict[str, torch.Tensor], state: Any) -> dict[str, torch.Tensor]:
        return latents


@dataclass(frozen=True)
class LatentConcat:
    """Channel-concatenate clean condition latents to the noisy ones (Wan2.2 I2V:
    ``[noise(16) | mask(4) | image latents(16)]`` -> 36 input channels)."""

    modality: str = "video"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> torch.Tensor:
        if condition is None:
            raise ValueError("this model needs conditioning latents (an input image); none were produced")
        return condition.latents

    def prepare(self, latents: dict[str, torch.Tensor], state: torch.Tensor) -> dict[str, torch.Tensor]:
        x = latents[self.modality]  # [B, C, f, h, w]
        cond = state.to(x.dtype)
        if cond.shape[0] != x.shape[0]:
            cond = cond.expand(x.shape[0], *cond.shape[1:])
        return {**latents, self.modality: torch.cat([x, cond], dim=1)}

    def post_step(self, latents: dict[str, torch.Tensor], state: Any) -> dict[str, torch.Tensor]:
        return latents


ConditioningPolicy = NoConditioning | LatentConcat
