"""ComfyUI's ``dpmpp_sde`` (DPM-Solver++ SDE, two model evaluations a step) on a flow model, with
its Brownian-tree noise; ``_gpu`` keeps the tree on the sample's device.

ComfyUI (``comfy/k_diffusion/sampling.py`` ``sample_dpmpp_sde``, read for behaviour; this code is
ours) steps ``sigma -> sigma'`` in the half log-SNR of a CONST model (``lambda = -logit(sigma)``,
``sigma(lambda) = sigmoid(-lambda)``, ``alpha = sigma exp(lambda)``): with ``h = lambda' - lambda``,
the midpoint ``lambda_1 = lambda + r h`` (``r = 1/2``) and k-diffusion's ancestral split of
``exp(-lambda) -> exp(-lambda_1)`` (resp. ``exp(-lambda')``) into ``(down, up)`` at ``eta``:

    x_2 = (alpha_1 / alpha) exp(-h_1) x - alpha_1 expm1(-h_1) denoised [+ alpha_1 eps_1 s_noise up_1]
    x   = (alpha' / alpha) exp(-h') x - alpha' expm1(-h') ((1 - 1/(2r)) denoised + 1/(2r) denoised_2)
          [+ alpha' eps s_noise up]

where ``h_1 = -log(down_1) - lambda`` (``h'`` likewise), ``denoised_2`` the model's clean estimate
at ``(x_2, sigma(lambda_1))``, and on the last step (``sigma' = 0``) ``x = denoised``. Each model
evaluation is one step of the denoise loop (as ``rk4_flow``'s stages): ``init_state(n)`` makes
``2 n - 1`` steps whose timesteps are ``sigma_i`` and ``sigma(lambda_1)`` alternately (the last
step is the one evaluation at the last sigma). A first sigma of 1 is offset as ``dpmpp_2m_sde``'s
(``model_shift``), and ``eps`` is its Brownian tree, queried ``(sigma, sigma_1)`` then ``(sigma,
sigma')``. Equal to ComfyUI's to the bit (tests/workflows/golden/comfy_samplers.json). A start from
given latents mid-schedule (strength < 1) is refused (it would land between a step's two evaluations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.comfy_dpmpp_2m_sde import ComfyDPMpp2MSDESampler, ComfyDPMpp2MSDEState
from omniloop.pipeline.samplers.comfy_sde import BrownianNoise, ancestral_step, flow_half_log_snr, flow_sigma
from omniloop.pipeline.samplers.joint_step import RowParts, step_each, step_jointly

R = 0.5  # SamplerDPMPP_SDE's r (KSampler's dpmpp_sde)


@dataclass(kw_only=True)
class ComfyDPMppSDEState(SamplerState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("start", "denoised")  # the request's own rows
    seed: int  # the prompt's seed: the Brownian tree's entropy
    schedule: torch.Tensor  # [n + 1] fp32: ComfyUI's sigmas (the first offset), ending with 0
    top_sigma: float  # the schedule's first sigma before the offset (the tree's upper end)
    start: torch.Tensor | None = None  # [b, ...] fp32: x at the step's first evaluation
    denoised: torch.Tensor | None = None  # [b, ...] fp32: its clean estimate
    noise: BrownianNoise | None = None  # built at the first noised evaluation


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMppSDESampler(ComfyDPMpp2MSDESampler):
    """ComfyUI's ``dpmpp_sde`` (``eta``, ``s_noise``, ``model_shift`` as ``comfy_dpmpp_2m_sde``'s)."""

    name: ClassVar[str] = "comfy_dpmpp_sde"
    diffusers_class: ClassVar[str] = "ComfyDPMppSDE"

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu, seed=seed)
        assert isinstance(base, ComfyDPMpp2MSDEState)
        schedule = base.sigmas  # [n + 1], the first offset as ComfyUI's offset_first_sigma_for_snr
        evaluations = []
        for i in range(num_steps):
            evaluations.append(schedule[i])
            if schedule[i + 1] != 0:  # the step's second evaluation, at the midpoint in half log-SNR
                lam, lam_next = flow_half_log_snr(schedule[i]), flow_half_log_snr(schedule[i + 1])
                evaluations.append(flow_sigma(lam + R * (lam_next - lam)))
        points = torch.stack(evaluations)  # [2 n - 1] (or [2 n] without a final 0)
        return ComfyDPMppSDEState(timesteps=(points * self.num_train_timesteps).to(base.timesteps.device),
                                  sigmas=torch.cat([points, torch.zeros(1)]), seed=base.seed, schedule=schedule,
                                  top_sigma=base.top_sigma)

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """At the first step only (strength 1: ComfyUI's noising at the schedule's own first sigma)."""
        assert isinstance(state, ComfyDPMppSDEState), f"{self.name} noises its own states"
        if state.step_index != 0:
            raise ValueError("sampler 'comfy_dpmpp_sde' does not start from given latents mid-schedule (strength < 1:"
                             " between a step's two evaluations): pass sampler='comfy_dpmpp_2m_sde', or strength 1")
        sigma = torch.tensor(state.top_sigma, dtype=original.dtype, device=original.device)
        return sigma * noise + (1.0 - sigma) * original

    def _interval(self, state: ComfyDPMppSDEState) -> tuple[int, bool]:
        """(ComfyUI's step i, whether this evaluation is its second) of the loop's step index."""
        i, k = 0, 0
        while True:
            evaluations = 1 if state.schedule[i + 1] == 0 else 2
            if state.step_index < k + evaluations:
                return i, state.step_index - k == 1
            i, k = i + 1, k + evaluations

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyDPMppSDEState) and not state.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i, second = self._interval(state)
        sigmas = state.schedule
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        x = sample.to(torch.float32)
        denoised = x - model_output.to(torch.float32) * state.sigmas[state.step_index]  # CONST's calculate_denoised
        lam, lam_next = flow_half_log_snr(sigma), flow_half_log_snr(sigma_next)
        h = lam_next - lam
        lam_1 = lam + R * h
        sigma_1 = flow_sigma(lam_1)
        alpha = sigma * lam.exp()
        eta, s_noise, noisy = self.eta, self.s_noise, self.eta > 0 and self.s_noise > 0
        if sigma_next == 0:
            out = denoised  # the denoising step
        elif not second:  # x -> x_2 at the midpoint
            alpha_1 = sigma_1 * lam_1.exp()
            down, up = ancestral_step(lam.neg().exp(), lam_1.neg().exp(), eta)
            h_ = down.log().neg() - lam
            out = (alpha_1 / alpha) * (-h_).exp() * x - alpha_1 * (-h_).expm1() * denoised
            if noisy:
                out = out + alpha_1 * self._brownian(state, x)(sigma, sigma_1, x.device) * s_noise * up
            state.start, state.denoised = x, denoised
        else:  # the step's update from both estimates
            assert state.start is not None and state.denoised is not None, "the first evaluation comes first"
            fac = 1 / (2 * R)
            alpha_t = sigma_next * lam_next.exp()
            down, up = ancestral_step(lam.neg().exp(), lam_next.neg().exp(), eta)
            h_ = down.log().neg() - lam
            denoised_d = (1 - fac) * state.denoised + fac * denoised
            out = (alpha_t / alpha) * (-h_).exp() * state.start - alpha_t * (-h_).expm1() * denoised_d
            if noisy:
                out = out + alpha_t * self._brownian(state, x)(sigma, sigma_next, x.device) * s_noise * up
            state.start = state.denoised = None
        state.step_index += 1
        return out.to(model_output.dtype)

    def _brownian(self, state: ComfyDPMppSDEState, like: torch.Tensor) -> BrownianNoise:
        """The request's tree over the run's sigmas (before the offset), built at its first use."""
        if state.noise is None:
            top = torch.tensor(state.top_sigma)
            state.noise = BrownianNoise.build(like, state.schedule, top, state.seed, self.tree_on_cpu)
        return state.noise

    def batch_key(self, state: SamplerState) -> Hashable:
        return (state.step_index, schedule_signature(state), self.eta, self.s_noise)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """Without noise one joint elementwise update; with noise each request alone (its tree)."""
        if not (self.eta > 0 and self.s_noise > 0):
            return step_jointly(self.step, states, model_output, sample, shared=("step_index",))
        return step_each(self.step, states, model_output, sample)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMppSDEGpuSampler(ComfyDPMppSDESampler):
    """ComfyUI's ``dpmpp_sde_gpu``: the Brownian tree on the sample's device."""

    name: ClassVar[str] = "comfy_dpmpp_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyDPMppSDEGpu"
    tree_on_cpu: ClassVar[bool] = False
