"""FLUX.1 Fill (inpainting / outpainting): diffusers ``FluxFillPipeline`` folders.

The Fill DiT reads 384 channels per packed token: the noisy latents (64 = 16 x 2x2), the
masked image's latents (64) and the mask at latent resolution (256 = the 8x8 pixel block of
each latent pixel, x 2x2). Kept unpacked in the loop, that is ``[16 | 16 | 64]`` channels
per latent pixel, which ``pack_latents`` turns into exactly diffusers' ``torch.cat`` of the
three packed tensors (pack is channel-major per token).

Mask semantics (diffusers'): white (>= 0.5 after grayscale) is the area to repaint, black is
kept; the masked image is the image with the repainted area set to 0 (mid-gray in [-1, 1]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from omniloop.io.image import image_to_tensor, open_image_part
from omniloop.models.families.flux.presets import FLUX_DEFAULTS
from omniloop.models.families.flux.stages import edit_source
from omniloop.pipeline.defaults import admitted_image
from omniloop.pipeline.edges import ConditionLatents, LatentPosterior
from omniloop.pipeline.policies.conditioning import Latents, LatentStart, NoConditioning, SamplerStates
from omniloop.pipeline.policies.noise_mask import NoiseMask, NoiseMaskSpec
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImagePart, InvalidRequest, OmniRequest

MASK_ROLE = "mask"
FILL_PIPELINE = "FluxFillPipeline"

# FluxFillPipeline's defaults: guidance 30 (the Fill model's embedded guidance), strength 1.0 (from noise)
FLUX_FILL_DEFAULTS = dataclasses.replace(FLUX_DEFAULTS, guidance_scale=30.0, strength=1.0)


def mask_part(request: OmniRequest) -> ImagePart | None:
    masks = request.images(MASK_ROLE)
    return masks[0] if masks else None


def mask_pixels(part: ImagePart, height: int, width: int) -> torch.Tensor:
    """The mask image as diffusers' mask processor reads it before binarizing: grayscale,
    resized (Lanczos) to height x width, in [0, 1] -> [1, 1, H, W] float32 (1: repaint)."""
    from PIL import Image

    image = open_image_part(part).convert("L")
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None, None]


def mask_to_tensor(part: ImagePart, height: int, width: int) -> torch.Tensor:
    """diffusers' mask processor: ``mask_pixels`` binarized at 0.5 -> [1, 1, H, W] of 0 / 1."""
    return (mask_pixels(part, height, width) >= 0.5).to(torch.float32)


def latent_mask(mask: torch.Tensor, scale: int) -> torch.Tensor:
    """[1, 1, H, W] -> [1, s*s, H/s, W/s]: each latent pixel's s x s block of mask pixels as
    channels (diffusers ``prepare_mask_latents``: view, permute(0, 2, 4, 1, 3))."""
    _, _, H, W = mask.shape
    h, w = H // scale, W // scale
    return mask[:, 0].view(1, h, scale, w, scale).permute(0, 2, 4, 1, 3).reshape(1, scale * scale, h, w)


@dataclass(kw_only=True)
class FillLatents(ConditionLatents):
    """The Fill condition: the image to start from (``latents`` / ``posterior``, as
    image-to-image's), the masked image's posterior (sampled after the start noise, diffusers'
    draw order) and the latent-resolution mask ``[1, 64, h, w]``."""

    masked: LatentPosterior
    mask: torch.Tensor


@dataclass
class FluxFillCondition(ComponentStage):
    """Image + mask -> FillLatents: the image and the masked image VAE-encoded (moments;
    the loop samples both from the request's seed), the mask binarized and unshuffled."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        request = state.request
        source, mask = edit_source(request), mask_part(request)
        assert isinstance(source, ImagePart) and mask is not None, "admission guarantees an image and a mask"
        vae = ctx.component(self.component)
        cfg = vae.config
        g = admitted_image(request, ctx.node)
        image = image_to_tensor(open_image_part(source), g.height, g.width).to(ctx.device)  # [1, 3, H, W]
        soft = mask_pixels(mask, g.height, g.width).to(ctx.device)  # [1, 1, H, W] in [0, 1]
        pixels = (soft >= 0.5).to(torch.float32)  # binarized, as diffusers' mask processor
        masked = image * (1 - pixels)
        # NOTE: diffusers encodes channels-last views (its processor's layout); same path, bit-equal
        start = vae.encode(image.contiguous(memory_format=torch.channels_last))
        hole = vae.encode(masked.contiguous(memory_format=torch.channels_last))
        shift, scale = cfg.shift_factor or 0.0, cfg.scaling_factor

        def posterior(m) -> LatentPosterior:
            return LatentPosterior(mean=m.mean, std=m.std, shift=shift, scale=scale)

        ctx.write(state, "condition", FillLatents(latents=vae.normalize_latents(start.mean), posterior=posterior(start),
                                                  masked=posterior(hole),
                                                  mask=latent_mask(pixels, cfg.scale_factor_spatial),
                                                  # ComfyUI's noise mask, when the loop's node params ask for it
                                                  noise_mask=NoiseMaskSpec(pixels=soft, mode=None)))


@dataclass
class FillState:
    """Per request: the Fill condition and, once the loop starts, the masked image's latents
    ``[1, 16, h, w]`` (its posterior sample)."""

    condition: FillLatents
    masked: torch.Tensor | None = field(default=None)
    noise_mask: NoiseMask | None = field(default=None)  # the loop's, when its node params name a mode


@dataclass(frozen=True)
class FillStart(NoConditioning):
    """LatentStart (start from the image at ``strength``; Fill's default 1.0 is pure noise),
    then the masked image's posterior sample as the third draw (diffusers: image sample,
    noise, masked-image sample); every forward reads ``[x | masked | mask]`` channels."""

    starts_from_condition: ClassVar[bool] = True

    modality: str = "image"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> FillState:
        if not isinstance(condition, FillLatents):
            raise InvalidRequest("FLUX.1 Fill needs an image and a mask", hint="pass ImagePart(role='mask') beside "
                                 "the image (over HTTP: the mask field)", fields=("inputs",))
        return FillState(condition=condition)

    def start(self, latents: Latents, samplers: SamplerStates, state: FillState, gen: torch.Generator | None,
              strength: float | None) -> tuple[Latents, SamplerStates]:
        base = LatentStart(modality=self.modality, input_port=self.input_port, name=self.name)
        started = base.init(state.condition)
        latents, samplers = base.start(latents, samplers, started, gen, 1.0 if strength is None else strength)
        state.noise_mask = base.noise_mask(started)
        first = latents[self.modality]
        assert gen is not None, "Fill starts from the request's seeded generator"
        eps = torch.randn(first.shape, generator=gen, dtype=torch.float32).to(first.device)
        state.masked = state.condition.masked.sample(eps)  # [1, 16, h, w], the DiT's space
        return latents, samplers

    def noise_mask(self, state: FillState) -> NoiseMask | None:
        return state.noise_mask

    def prepare(self, latents: Latents, state: FillState) -> Latents:
        x = latents[self.modality]  # [B, 16, h, w]
        assert state.masked is not None, "start() samples the masked image"
        cond = torch.cat([state.masked, state.condition.mask.to(state.masked.device)], dim=1).to(x.dtype)
        if cond.shape[0] != x.shape[0]:
            cond = cond.expand(x.shape[0], *cond.shape[1:])
        return {**latents, self.modality: torch.cat([x, cond], dim=1)}  # [B, 96, h, w] -> 384 packed
