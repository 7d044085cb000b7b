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
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.comfy_dpmpp_2m_sde import ComfyDPMpp2MSDESampler, ComfyDPMpp2MSDEState
from omniloop.pipeline.samplers.joint_step import step_each, step_jointly


@dataclass(kw_only=True)
class ComfyDPMpp3MSDEState(ComfyDPMpp2MSDEState):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("old_denoised", "older_denoised")  # the request's own rows
    older_denoised: torch.Tensor | None = None  # [b, ...] fp32: the estimate two steps back
    h_older: torch.Tensor | None = None  # the ``h`` two steps back (0-d)


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

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyDPMpp3MSDEState) and not state.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
        x = sample.to(torch.float32)
        denoised = self._denoised(x, model_output.to(torch.float32), sigma)
        h = state.h_last
        if sigma_next == 0:
            out = denoised  # the denoising step
        else:
            h = self._lambda(sigma_next) - self._lambda(sigma)
            out = self._update3(state, x, denoised, sigma, sigma_next, h)
        state.older_denoised, state.old_denoised = state.old_denoised, denoised
        state.h_older, state.h_last = state.h_last, h
        state.step_index += 1
        return out.to(model_output.dtype)

    def _update3(self, state: ComfyDPMpp3MSDEState, x: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor,
                 sigma_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # NOTE: ComfyUI's order of products, so rows round as there
        eta, s_noise = self.eta, self.s_noise
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
        if eta > 0 and s_noise > 0:
            eps = self._noise(state, x)(sigma, sigma_next, x.device)
            x = x + eps * sigma_next * (-2 * h * eta).expm1().neg().sqrt() * s_noise
        return x

    def batch_key(self, state: SamplerState) -> Hashable:
        assert isinstance(state, ComfyDPMpp3MSDEState)
        return (state.step_index, schedule_signature(state), state.old_denoised is None,
                state.older_denoised is None, self.eta, self.s_noise)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        if not (self.eta > 0 and self.s_noise > 0):
            return step_jointly(self.step, states, model_output, sample, shared=("step_index", "h_last", "h_older"))
        return step_each(self.step, states, model_output, sample)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp3MSDEGpuSampler(ComfyDPMpp3MSDESampler):
    """ComfyUI's ``dpmpp_3m_sde_gpu``: the Brownian tree on the sample's device."""

    name: ClassVar[str] = "comfy_dpmpp_3m_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyDPMpp3MSDEGpu"
    tree_on_cpu: ClassVar[bool] = False
