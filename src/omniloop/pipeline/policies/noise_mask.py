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

from dataclasses import dataclass
from typing import Literal

import torch

NoiseMaskMode = Literal["diffusers", "comfy"]
NOISE_MASK_MODES: tuple[NoiseMaskMode, ...] = ("diffusers", "comfy")


@dataclass(frozen=True)
class NoiseMaskSpec:
    """What a condition stage hands the loop: the mask at latent resolution ([1, 1, h, w] or
    [1, C, h, w], 1: repaint) and the convention it is applied by."""

    mask: torch.Tensor
    mode: NoiseMaskMode = "diffusers"

    def __post_init__(self) -> None:
        assert self.mode in NOISE_MASK_MODES, f"noise mask mode {self.mode!r} is not one of {NOISE_MASK_MODES}"


@dataclass
class NoiseMask:
    """Per request, once the loop starts: the mask, the clean latents the kept area comes from
    and the noise the loop started from (both [B, C, h, w] fp32, the loop's latent layout)."""

    modality: str
    mask: torch.Tensor  # [1|B, 1|C, h, w] fp32, 1: repaint
    clean: torch.Tensor
    noise: torch.Tensor
    mode: NoiseMaskMode

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


def latent_noise_mask(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[1, 1, H, W] pixel mask -> [1, 1, h, w] at latent resolution by nearest sampling
    (diffusers' ``prepare_mask_latents``: ``F.interpolate(mask, size=(h, w))``)."""
    return torch.nn.functional.interpolate(pixels, size=(height, width))
