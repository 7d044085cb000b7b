"""ComfyUI's ``dpmpp_3m_sde`` (DPM-Solver++(3M) SDE) on a flow model, with its Brownian-tree noise;
``_gpu`` keeps the tree on the sample's device.

ComfyUI (``comfy/k_diffusion/sampling.py`` ``sample_dpmpp_3m_sde``, read for behaviour; this code
is ours) is ``dpmpp_2m_sde``'s step (half log-SNR, the first sigma of 1 offset, ``x = denoised`` on
the last step) with a third-order correction once two earlier estimates exist. With ``h_eta =
h (eta + 1)``, ``phi_2 = expm1(-h_eta) / h_eta + 1``, ``phi_3 = phi_2 / h_eta - 1/2``,
``r0 = h_1 / h``, ``r1 = h_2 / h`` (the previous two steps' ``h``):

    x = (sigma' / sigma) exp(-h eta) x + alpha' (1 - exp(-h_eta)) denoised
    x += alpha' phi_2 d1 - alpha' phi_3 d2            d1_0 = (D - D_1) / r0, d1_1 = (D_1 - D_2) / r1,
                                                      d1 = d1_0 + (d1_0 - d1_1) r0 / (r0 + r1), d2 = (d1_0 - d1_1) / (r0 + r1)
      | x += alpha' phi_2 (D - D_1) / r0              (one earlier estimate)
    x += eps sigma' sqrt(1 - exp(-2 h eta)) s_noise   (eta, s_noise > 0)

Equal to ComfyUI's to the bit (tests/workflows/golden/comfy_samplers.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler
from omniloop.pipeline.samplers.comfy_dpmpp_2m_sde import ComfyDPMpp2MSDESampler, ComfyDPMpp2MSDEState


@dataclass(kw_only=True)
class ComfyDPMpp3MSDEState(ComfyDPMpp2MSDEState):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("old_denoised", "older_denoised")  # the request's own rows
    older_denoised: torch.Tensor | None = None  # [b, ...] fp32: the estimate two steps back
    h_older: torch.Tensor | None = None  # the ``h`` two steps back (0-d)
    SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("step_index", "h_last", "h_older")

    def remember(self, denoised: torch.Tensor, h: torch.Tensor | None) -> None:
        self.older_denoised, self.old_denoised = self.old_denoised, denoised
        self.h_older, self.h_last = self.h_last, h

    def history_missing(self) -> tuple[bool, ...]:
        return (self.old_denoised is None, self.older_denoised is None)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp3MSDESampler(ComfyDPMpp2MSDESampler):
    """ComfyUI's ``dpmpp_3m_sde`` (``eta``, ``s_noise``, ``model_shift`` as ``comfy_dpmpp_2m_sde``'s)."""

    name: ClassVar[str] = "comfy_dpmpp_3m_sde"
    diffusers_class: ClassVar[str] = "ComfyDPMpp3MSDE"

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu, seed=seed)
        assert isinstance(base, ComfyDPMpp2MSDEState)
        return ComfyDPMpp3MSDEState(timesteps=base.timesteps, sigmas=base.sigmas, seed=base.seed,
                                    top_sigma=base.top_sigma)

    def _update(self, state: ComfyDPMpp2MSDEState, x: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor,
                sigma_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``dpmpp_2m_sde``'s step with the third-order correction (the module's formula)."""
        # NOTE: ComfyUI's order of products, so rows round as there
        assert isinstance(state, ComfyDPMpp3MSDEState), f"{self.name} steps its own states"
        eta = self.eta
        h_eta = h * (eta + 1)
        alpha_t = sigma_next * self._lambda(sigma_next).exp()
        x = sigma_next / sigma * (-h * eta).exp() * x + alpha_t * (-h_eta).expm1().neg() * denoised
        if state.h_older is not None and state.older_denoised is not None:
            assert state.h_last is not None and state.old_denoised is not None
            r0, r1 = state.h_last / h, state.h_older / h
            d1_0 = (denoised - state.old_denoised) / r0
            d1_1 = (state.old_denoised - state.older_denoised) / r1
            d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
            d2 = (d1_0 - d1_1) / (r0 + r1)
            phi_2 = h_eta.neg().expm1() / h_eta + 1
            phi_3 = phi_2 / h_eta - 0.5
            x = x + (alpha_t * phi_2) * d1 - (alpha_t * phi_3) * d2
        elif state.h_last is not None and state.old_denoised is not None:
            r = state.h_last / h
            d = (denoised - state.old_denoised) / r
            phi_2 = h_eta.neg().expm1() / h_eta + 1
            x = x + (alpha_t * phi_2) * d
        return self._noised(state, x, sigma, sigma_next, h)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp3MSDEGpuSampler(ComfyDPMpp3MSDESampler):
    """ComfyUI's ``dpmpp_3m_sde_gpu``: the Brownian tree on the sample's device."""

    name: ClassVar[str] = "comfy_dpmpp_3m_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyDPMpp3MSDEGpu"
    tree_on_cpu: ClassVar[bool] = False
