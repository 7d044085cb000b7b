"""ComfyUI's ``res_multistep`` (and ``res_multistep_ancestral``) as its KSampler runs it on a flow model.

ComfyUI (``comfy/k_diffusion/sampling.py`` ``res_multistep``, read for behaviour; this code is ours)
runs the second-order multistep exponential integrator of arXiv 2308.02157 in ``t = -log sigma``
on the clean estimate ``denoised = x - v * sigma`` (CONST). Per step ``sigma -> sigma'``, with
k-diffusion's ancestral split ``sigma' -> (sigma_down, sigma_up)`` (``eta = 0``: ``(sigma', 0)``):

    first step, or sigma_down = 0:  x = x + (x - denoised) / sigma * (sigma_down - sigma)      (Euler)
    otherwise:                      h = t(sigma_down) - t(sigma), c2 = (t(sigma_prev) - t(sigma_down_prev)) / h
                                    x = exp(-h) x + h (b1 denoised + b2 denoised_prev),
                                    b1 = phi1(-h) - phi2(-h) / c2, b2 = phi2(-h) / c2 (NaN read as 0)
    then, if sigma' > 0:            x = x + eps * s_noise * sigma_up

with ``phi1(z) = expm1(z) / z``, ``phi2(z) = (phi1(z) - 1) / z``. ``eps`` is ComfyUI's
``default_noise_sampler`` (``comfy_euler_ancestral``'s: one generator seeded with the prompt's
seed, ``+ 1`` on the CPU); ``res_multistep`` is ``eta = 0`` (its noise term is zero, so nothing is
drawn). Equal to ComfyUI's to the bit (tests/workflows/golden/comfy_samplers.json). The schedule
is ``flow_euler``'s (a workflow hands ComfyUI's sigmas with shift 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.comfy_euler_ancestral import ComfyAncestralState, generators_rewound_on_raise
from omniloop.pipeline.samplers.comfy_sde import ancestral_step, check_noise_options, seed_or_draw, ve_half_log_snr
from omniloop.pipeline.samplers.flow_euler import ComfyScheduleSampler
from omniloop.pipeline.samplers.joint_step import RowParts, step_each, step_jointly


@dataclass(kw_only=True)
class ComfyResMultistepState(ComfyAncestralState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("old_denoised",)  # the request's own rows
    old_denoised: torch.Tensor | None = None  # [b, ...] fp32: the previous step's clean estimate of this run
    old_sigma_down: torch.Tensor | None = None  # the previous step's sigma_down (0-d)


def _phi1(z: torch.Tensor) -> torch.Tensor:
    return torch.expm1(z) / z


def _phi2(z: torch.Tensor) -> torch.Tensor:
    return (_phi1(z) - 1.0) / z


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyResMultistepSampler(ComfyScheduleSampler):
    """ComfyUI's ``res_multistep`` (``eta = 0``); the schedule fields are ``flow_euler``'s."""

    name: ClassVar[str] = "comfy_res_multistep"
    # NOTE: a distinct name keeps checkpoint configs mapping to flow_euler (sampler_for_diffusers_class)
    diffusers_class: ClassVar[str] = "ComfyResMultistep"

    eta: float = 0.0
    s_noise: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_options(self.eta, self.s_noise)

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu)
        return ComfyResMultistepState(timesteps=base.timesteps, sigmas=base.sigmas, seed=seed_or_draw(seed))

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyResMultistepState) and not state.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        sigmas = state.sigmas
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        x = sample.to(torch.float32)
        denoised = x - model_output.to(torch.float32) * sigma  # CONST's calculate_denoised
        sigma_down, sigma_up = ancestral_step(sigma, sigma_next, self.eta)
        if sigma_down == 0 or state.old_denoised is None:  # Euler
            x = x + (x - denoised) / sigma * (sigma_down - sigma)
        else:
            assert state.old_sigma_down is not None, "a previous estimate comes with its sigma_down"
            t, t_old = ve_half_log_snr(sigma), ve_half_log_snr(state.old_sigma_down)
            t_next, t_prev = ve_half_log_snr(sigma_down), ve_half_log_snr(sigmas[i - 1])
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1, phi2 = _phi1(-h), _phi2(-h)
            b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
            b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
            x = h.neg().exp() * x + h * (b1 * denoised + b2 * state.old_denoised)
        if sigma_next > 0 and self.eta:  # at eta 0 ComfyUI adds its noise times 0: x itself
            x = x + state.noise(x) * self.s_noise * sigma_up
        state.old_denoised = denoised
        state.old_sigma_down = sigma_down
        state.step_index += 1
        return x.to(model_output.dtype)

    def batch_key(self, state: SamplerState) -> Hashable:
        assert isinstance(state, ComfyResMultistepState)
        return (state.step_index, schedule_signature(state), state.old_denoised is None, self.eta, self.s_noise)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """Requests of one ``batch_key``: without noise one joint elementwise update; with noise
        each request alone on its rows (its own generator), a raise rewinding the generators."""
        if not self.eta:
            return step_jointly(self.step, states, model_output, sample, shared=("step_index", "old_sigma_down"))
        with generators_rewound_on_raise(states):
            return step_each(self.step, states, model_output, sample)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyResMultistepAncestralSampler(ComfyResMultistepSampler):
    """ComfyUI's ``res_multistep_ancestral`` (``eta``, ``s_noise``: its defaults 1, 1)."""

    name: ClassVar[str] = "comfy_res_multistep_ancestral"
    diffusers_class: ClassVar[str] = "ComfyResMultistepAncestral"
    options: ClassVar[tuple[str, ...]] = ("eta", "s_noise")
    request_knobs: ClassVar[tuple[str, ...]] = ("eta", "s_noise")

    eta: float = 1.0
