"""The toy family's adapter to the shared ``DenoiseLoop``: latent shapes, per-branch forward
inputs, the forward, and its analytic cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from omniloop.pipeline.defaults import admitted
from omniloop.pipeline.loops.denoise import DenoiserBase, text_branch_inputs
from omniloop.pipeline.policies.cfg import Prediction
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import OmniRequest

from .vae import SCALE_SPATIAL, SCALE_TEMPORAL

VIDEO = "video"


@dataclass(frozen=True)
class ToyGeometry:
    height: int
    width: int
    num_frames: int


def geometry(request: OmniRequest, node: str = "admission") -> ToyGeometry:
    """The resolved request's size (admission filled in the model's defaults where it set
    none: ``resolve_request``; an image is one frame)."""
    p = request.diffusion
    return ToyGeometry(height=admitted(p.height, "height", node), width=admitted(p.width, "width", node),
                       num_frames=admitted(p.num_frames, "num_frames", node))


@dataclass(frozen=True)
class ToyDenoiser(DenoiserBase):
    """``ToyDiT`` as the DenoiseLoop sees it: one ``video`` latent [1, C, F, H/4, W/4]."""

    modalities: tuple[str, ...] = (VIDEO,)

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g = geometry(request, ctx.node)
        frames = (g.num_frames - 1) // SCALE_TEMPORAL + 1
        channels = ctx.component("transformer").config.latent_channels
        return {VIDEO: (1, channels, frames, g.height // SCALE_SPATIAL, g.width // SCALE_SPATIAL)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        return text_branch_inputs(ctx, state, branches)

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        return {VIDEO: model(inputs[VIDEO], timestep, **kwargs)}

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        _, _, f, h, w = shapes[VIDEO]
        p = ctx.component("transformer").config.patch_size
        return f * (h // p) * (w // p)

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs (2 per multiply-add) of one forward: per block, self-attention
        projections and scores, cross-attention, the MLP."""
        cfg = ctx.component("transformer").config
        n, lt, d = self.tokens_per_forward(ctx, shapes), ctx.defaults.max_sequence_length or 16, cfg.dim
        per_block = 4 * n * d * d + 2 * n * n * d + 2 * n * d * d + 2 * lt * d * d + 2 * n * lt * d + 2 * n * d * cfg.ffn_dim
        return float(2 * cfg.layers * per_block)
