"""Inpainting on a plain FLUX.1 model (diffusers' ``FluxInpaintPipeline``): image-to-image
whose mask becomes the loop's latent noise mask (policies/noise_mask.py), so the area outside
the mask stays the image's. FLUX.1 Fill reads its mask as model input instead (fill.py).

Mask semantics: grayscale, resized (Lanczos) to the image, white repaints; at latent resolution
diffusers' way (binarized at 0.5, nearest pixel) or ComfyUI's (soft, bilinear) by the loop's
noise mask mode (NoiseMaskSpec.latent_mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from omniloop.models.families.flux.fill import mask_part, mask_pixels
from omniloop.models.families.flux.stages import FluxImageCondition
from omniloop.pipeline.defaults import admitted_image
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.policies.noise_mask import NoiseMaskSpec
from omniloop.pipeline.state import RequestState, StageContext


@dataclass
class FluxInpaintCondition(FluxImageCondition):
    """Image-to-image's condition, with the request's mask (if any) as its noise mask."""

    def condition(self, ctx: StageContext, state: RequestState) -> ConditionLatents:
        condition = super().condition(ctx, state)
        part = mask_part(state.request)
        if part is None:
            return condition
        g = admitted_image(state.request, ctx.node)
        pixels = mask_pixels(part, g.height, g.width).to(ctx.device)  # [1, 1, H, W] in [0, 1]
        return dataclasses.replace(condition, noise_mask=NoiseMaskSpec(pixels=pixels))
