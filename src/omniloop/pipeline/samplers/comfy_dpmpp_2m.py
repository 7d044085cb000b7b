"""ComfyUI's ``dpmpp_2m`` (DPM-Solver++(2M)) as its KSampler runs it on a flow model.

ComfyUI (``comfy/k_diffusion/sampling.py`` ``sample_dpmpp_2m``, read for behaviour; this code is
ours) works in ``t = -log(sigma)`` on the model's clean estimate ``denoised = x - v * sigma``
(CONST). Per step ``sigma -> sigma'``, ``h = t' - t``:

    x = (sigma' / sigma) * x - expm1(-h) * D,   D = denoised                                  (first step, last step)
                                                D = (1 + 1/(2r)) denoised - 1/(2r) denoised_prev, r = h_prev / h

with the exponentials taken as ComfyUI takes them (``exp(-t') / exp(-t)``), so the last step
(``sigma' = 0``, ``t' = inf``) gives ``denoised``. It is diffusers' DPM-Solver++ in form but not
on a flow model's sigmas (ComfyUI applies the k-diffusion VE formulas to the flow sample), so it
has a file of its own, equal to ComfyUI's to float rounding (tests/workflows/golden/comfy_samplers.json).
The schedule is ``flow_euler``'s (a workflow hands ComfyUI's sigmas with shift 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.comfy_sde import ve_half_log_snr, ve_sigma
from omniloop.pipeline.samplers.flow_euler import ComfyScheduleSampler
from omniloop.pipeline.samplers.joint_step import RowParts, step_jointly


@dataclass(kw_only=True)
class ComfyDPMpp2MState(SamplerState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("old_denoised",)  # the request's own rows
    old_denoised: torch.Tensor | None = None  # [b, ...] fp32: the previous step's clean estimate of this run


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp2MSampler(ComfyScheduleSampler):
    """ComfyUI's ``dpmpp_2m``; the schedule fields are ``flow_euler``'s."""

    name: ClassVar[str] = "comfy_dpmpp_2m"
    # NOTE: a distinct name keeps checkpoint configs mapping to flow_euler (sampler_for_diffusers_class)
    diffusers_class: ClassVar[str] = "ComfyDPMpp2M"

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu)
        return ComfyDPMpp2MState(timesteps=base.timesteps, sigmas=base.sigmas)

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyDPMpp2MState) and not state.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        sigmas = state.sigmas
        x = sample.to(torch.float32)
        denoised = self._denoised(x, model_output.to(torch.float32), sigmas[i])
        t, t_next = ve_half_log_snr(sigmas[i]), ve_half_log_snr(sigmas[i + 1])
        h = t_next - t
        if state.old_denoised is None or sigmas[i + 1] == 0:
            target = denoised
        else:
            r = (t - ve_half_log_snr(sigmas[i - 1])) / h
            target = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * state.old_denoised
        out = (ve_sigma(t_next) / ve_sigma(t)) * x - (-h).expm1() * target
        state.old_denoised = denoised
        state.step_index += 1
        return out.to(model_output.dtype)

    @staticmethod
    def _denoised(x: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The clean estimate of the model's prediction (CONST's ``calculate_denoised``; fp32)."""
        return x - model_output * sigma

    def batch_key(self, state: SamplerState) -> Hashable:
        assert isinstance(state, ComfyDPMpp2MState)
        return (state.step_index, schedule_signature(state), state.old_denoised is None)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """One step for requests of one ``batch_key``: their previous estimates joined, one
        elementwise update (``step_jointly``), each row equal to its ``step`` alone."""
        return step_jointly(self.step, states, model_output, sample, shared=("step_index",))
