"""A latent noise mask: inpainting on any flow model by keeping the unmasked area of the
given latents through the loop (per request; the loop applies it, ``DenoiseLoop``).

Two conventions, both on flow latents ``x_sigma = sigma * noise + (1 - sigma) * clean``:

* ``diffusers`` (FluxInpaintPipeline and its kin): after each sampler step the kept area is
  reset to the clean latents noised to the *next* sigma with the loop's starting noise,
  ``x = (1 - m) * scale_noise(clean, sigma_next, noise) + m * x`` (the clean latents exactly
  after the last step).
* ``comfy`` (ComfyUI's KSampler noise mask, ``KSamplerX0Inpaint``): before each model call the
  model's *input* is blended, ``x_in = m * x + (1 - m) * (sigma * noise + (1 - sigma) * clean)``,
  and the model's clean-sample estimate is blended, ``x0 = m * x0 + (1 - m) * clean``; the
  sampler then steps from its own ``x`` with that estimate (flow: ``v = (x - x0) / sigma``).

``m`` is 1 where the image is repainted and 0 where it is kept (fractions blend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

NoiseMaskMode = Literal["diffusers", "comfy"]
NOISE_MASK_MODES: tuple[NoiseMaskMode, ...] = ("diffusers", "comfy")


@dataclass(frozen=True)
class NoiseMaskSpec:
    """What a condition stage hands the loop: the request's mask at the image's resolution
    ([1, 1, H, W] in [0, 1], 1: repaint; soft values kept) and the convention it applies by
    (None: only when the loop's ``noise_mask`` node param names one, e.g. FLUX.1 Fill, whose
    model reads the mask itself)."""

    pixels: torch.Tensor
    mode: NoiseMaskMode | None = "diffusers"

    def __post_init__(self) -> None:
        assert self.mode is None or self.mode in NOISE_MASK_MODES, (
            f"noise mask mode {self.mode!r} is not one of {NOISE_MASK_MODES}")

    def latent_mask(self, mode: NoiseMaskMode, height: int, width: int) -> torch.Tensor:
        """[1, 1, h, w] at latent resolution, each convention's way: diffusers binarizes at 0.5
        and samples the nearest pixel (``mask_processor`` + ``prepare_mask_latents``); ComfyUI
        resizes the soft mask bilinearly (``prepare_mask`` / ``reshape_mask``)."""
        if mode == "diffusers":
            return torch.nn.functional.interpolate((self.pixels >= 0.5).to(torch.float32), size=(height, width))
        return torch.nn.functional.interpolate(self.pixels.to(torch.float32), size=(height, width), mode="bilinear")


@dataclass
class NoiseMask:
    """Per request, once the loop starts: the mask, the clean latents the kept area comes from
    and the noise the loop started from (both [B, C, h, w] fp32, the loop's latent layout).
    ``mode`` None: inactive (the loop drops it unless its node params name a mode)."""

    modality: str
    spec: NoiseMaskSpec
    clean: torch.Tensor
    noise: torch.Tensor
    mode: NoiseMaskMode | None
    mask: torch.Tensor = field(init=False)  # [1, 1, h, w] fp32, 1: repaint

    def __post_init__(self) -> None:
        self.set_mode(self.mode)

    def set_mode(self, mode: NoiseMaskMode | None) -> None:
        self.mode = mode
        h, w = self.clean.shape[-2:]
        self.mask = self.spec.latent_mask(mode or "diffusers", h, w).to(self.clean.device)

    def noised(self, sigma: torch.Tensor) -> torch.Tensor:
        """The clean latents at ``sigma`` with the starting noise (diffusers' ``scale_noise``)."""
        return sigma * self.noise + (1.0 - sigma) * self.clean

    # -- comfy: before the forward, and on its clean-sample estimate --------------------------
    def model_input(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - self.mask
        return x * self.mask + self.noised(sigma) * keep

    def prediction(self, x: torch.Tensor, x_in: torch.Tensor, sigma: torch.Tensor,
                   velocity: torch.Tensor) -> torch.Tensor:
        """The flow velocity the sampler steps ``x`` with, so that its clean estimate is
        ComfyUI's blended one: ``x0 = m * (x_in - sigma * v) + (1 - m) * clean``."""
        x0 = (x_in - sigma * velocity) * self.mask + self.clean * (1.0 - self.mask)
        return (x - x0) / sigma

    # -- diffusers: after the sampler step ---------------------------------------------------
    def after_step(self, x: torch.Tensor, sigma_next: torch.Tensor | None) -> torch.Tensor:
        """``sigma_next`` None: the step was the last (the kept area is the clean latents)."""
        proper = self.clean if sigma_next is None else self.noised(sigma_next)
        return (1 - self.mask) * proper + self.mask * x
