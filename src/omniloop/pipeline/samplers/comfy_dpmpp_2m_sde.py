"""ComfyUI's ``dpmpp_2m_sde`` (DPM-Solver++(2M) SDE) as its KSampler runs it on a flow model, with
its Brownian-tree noise; ``_gpu`` and ``_heun`` are its variants of the same name.

ComfyUI (``comfy/k_diffusion/sampling.py`` ``sample_dpmpp_2m_sde``, read for behaviour; this code
is ours) works in the half log-SNR of a CONST (flow) model, ``lambda = -logit(sigma)``, on the
clean estimate ``denoised = x - v * sigma``. Per step ``sigma -> sigma'`` (``h = lambda' - lambda``,
``h_eta = h (eta + 1)``, ``alpha' = 1 - sigma'`` as ``sigma' exp(lambda')``):

    x = (sigma' / sigma) exp(-h eta) x + alpha' (1 - exp(-h_eta)) denoised
      + [midpoint] 1/2 alpha' (1 - exp(-h_eta)) / r (denoised - denoised_prev)          (from the 2nd step)
      | [heun]     alpha' ((1 - exp(-h_eta)) / (-h_eta) + 1) / r (denoised - denoised_prev)
      + eps sigma' sqrt(1 - exp(-2 h eta)) s_noise                                       (eta, s_noise > 0)

with ``r = h_prev / h``, and ``x = denoised`` on the last step (``sigma' = 0``). A schedule that
starts at sigma 1 (logit infinite) starts at ``percent_to_sigma(1e-4)`` of the model's sampling
instead, ``shift t / (1 + (shift - 1) t)`` at ``t = 1 - 1e-4`` (``offset_first_sigma_for_snr``):
the model is evaluated there, as in ComfyUI. ``model_shift`` is that shift (ModelSamplingSD3's:
a workflow hands its shifted sigmas with shift 1); unset, the request's schedule shift.

``eps`` is ComfyUI's ``BrownianTreeNoiseSampler``: one ``torchsde.BrownianTree`` per request over
``[min positive sigma, max sigma]`` of the run (before the offset), seeded (``entropy``) with the
prompt's seed, its state the shape of the request's sample (``w0`` zeros), queried per noised
step for the increment between ``sigma'`` and ``sigma`` and divided by ``sqrt(sigma - sigma')``.
``dpmpp_2m_sde`` keeps the tree on the CPU, ``_gpu`` on the sample's device (on a CPU sample the
two are the same draws). So a request equals ComfyUI's run of the same seed, sigmas and model
(tests/workflows/golden/comfy_samplers.json). Needs ``torchsde`` (the ``audio`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import (SamplerState, SchedulerConfigError, register_sampler,
                                             schedule_signature)
from omniloop.pipeline.samplers.comfy_sde import BrownianNoise, check_noise_options, flow_half_log_snr, seed_or_draw
from omniloop.pipeline.samplers.flow_euler import ComfyScheduleSampler
from omniloop.pipeline.samplers.joint_step import RowParts, step_each, step_jointly

_OPTIONS = ("eta", "s_noise", "model_shift")
PERCENT_OFFSET = 1e-4  # ComfyUI's offset_first_sigma_for_snr


@dataclass(kw_only=True)
class ComfyDPMpp2MSDEState(SamplerState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("old_denoised",)  # the request's own rows
    seed: int  # the prompt's seed: the Brownian tree's entropy
    top_sigma: float  # the schedule's first sigma before the offset (the tree's upper end at step 0)
    old_denoised: torch.Tensor | None = None  # [b, ...] fp32: the previous step's clean estimate of this run
    h_last: torch.Tensor | None = None  # the previous step's half log-SNR step (0-d)
    noise: BrownianNoise | None = None  # built at the run's first noised step
    # what a batch's requests share and ``step_jointly`` advances once (the rest are rows or per request)
    SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("step_index", "h_last")

    def remember(self, denoised: torch.Tensor, h: torch.Tensor | None) -> None:
        """Keep this step's clean estimate and ``h`` for the next step's correction."""
        self.old_denoised, self.h_last = denoised, h

    def history_missing(self) -> tuple[bool, ...]:
        """Which earlier estimates the next correction lacks (requests batch only alike)."""
        return (self.old_denoised is None,)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp2MSDESampler(ComfyScheduleSampler):
    """ComfyUI's ``dpmpp_2m_sde`` (midpoint; the tree on the CPU); the schedule fields are
    ``flow_euler``'s, ``eta`` / ``s_noise`` the sampler node's, ``model_shift`` the model sampling's."""

    name: ClassVar[str] = "comfy_dpmpp_2m_sde"
    # NOTE: a distinct name keeps checkpoint configs mapping to flow_euler (sampler_for_diffusers_class)
    diffusers_class: ClassVar[str] = "ComfyDPMpp2MSDE"
    options: ClassVar[tuple[str, ...]] = _OPTIONS
    request_knobs: ClassVar[tuple[str, ...]] = _OPTIONS
    solver_type: ClassVar[str] = "midpoint"
    tree_on_cpu: ClassVar[bool] = True

    eta: float = 1.0
    s_noise: float = 1.0
    model_shift: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_options(self.eta, self.s_noise, "SamplerDPMPP_2M_SDE")
        if self.model_shift is not None and not self.model_shift > 0:
            raise SchedulerConfigError(f"model_shift must be > 0, got {self.model_shift!r}")

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu)
        schedule = base.sigmas.clone()
        top = float(schedule[0])
        if top >= 1:  # offset_first_sigma_for_snr: the logit of 1 is infinite
            model_shift = self.model_shift if self.model_shift is not None else (
                self.shift if shift is None else float(shift))
            t = 1.0 - PERCENT_OFFSET
            schedule[0] = t if model_shift == 1.0 else model_shift * t / (1 + (model_shift - 1) * t)
        timesteps = (schedule[:-1] * self.num_train_timesteps).to(base.timesteps.device)
        return ComfyDPMpp2MSDEState(timesteps=timesteps, sigmas=schedule, seed=seed_or_draw(seed), top_sigma=top)

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``flow_euler``'s, except at the first step of a schedule whose first sigma was offset:
        ComfyUI noises the latents at the schedule's own first sigma (before the sampler offsets it)."""
        assert isinstance(state, ComfyDPMpp2MSDEState), f"{self.name} noises its own states"
        if state.step_index == 0 and state.top_sigma != float(state.sigmas[0]):
            sigma = torch.tensor(state.top_sigma, dtype=original.dtype, device=original.device)
            return sigma * noise + (1.0 - sigma) * original
        return super().add_noise(state, original, noise)

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyDPMpp2MSDEState) and not state.done, "step() after the last step"
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
            out = self._update(state, x, denoised, sigma, sigma_next, h)
        state.remember(denoised, h)
        state.step_index += 1
        return out.to(model_output.dtype)

    def _update(self, state: ComfyDPMpp2MSDEState, x: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor,
                sigma_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # NOTE: the products are taken in ComfyUI's order (scalars first), so rows round as there
        eta = self.eta
        h_eta = h * (eta + 1)
        alpha_t = sigma_next * self._lambda(sigma_next).exp()
        x = sigma_next / sigma * (-h * eta).exp() * x + alpha_t * (-h_eta).expm1().neg() * denoised
        if state.old_denoised is not None:
            assert state.h_last is not None, "a previous estimate comes with its step"
            r = state.h_last / h
            if self.solver_type == "heun":
                x = x + alpha_t * ((-h_eta).expm1().neg() / (-h_eta) + 1) * (1 / r) * (denoised - state.old_denoised)
            else:
                x = x + 0.5 * alpha_t * (-h_eta).expm1().neg() * (1 / r) * (denoised - state.old_denoised)
        return self._noised(state, x, sigma, sigma_next, h)

    def _noised(self, state: ComfyDPMpp2MSDEState, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                h: torch.Tensor) -> torch.Tensor:
        """``x + eps sigma' sqrt(1 - exp(-2 h eta)) s_noise`` (``x`` itself at eta or s_noise 0)."""
        eta, s_noise = self.eta, self.s_noise
        if not (eta > 0 and s_noise > 0):
            return x
        eps = self._noise(state, x)(sigma, sigma_next, x.device)
        return x + eps * sigma_next * (-2 * h * eta).expm1().neg().sqrt() * s_noise

    @staticmethod
    def _denoised(x: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The clean estimate of the model's prediction (CONST's ``calculate_denoised``; fp32)."""
        return x - model_output * sigma

    @staticmethod
    def _lambda(sigma: torch.Tensor) -> torch.Tensor:
        """The half log-SNR of ``sigma`` (CONST's: ``-logit(sigma)``)."""
        return flow_half_log_snr(sigma)

    def _noise(self, state: ComfyDPMpp2MSDEState, like: torch.Tensor) -> BrownianNoise:
        """The request's tree, built over this run's sigmas (a run from given latents starts at
        ``step_index``: ComfyUI's run over the rest of the schedule) at its first noised step."""
        if state.noise is None:
            start = state.step_index
            rest = state.sigmas[start:]
            top = torch.tensor(state.top_sigma) if start == 0 else rest[0]
            state.noise = BrownianNoise.build(like, rest, top, state.seed, self.tree_on_cpu)
        return state.noise

    def batch_key(self, state: SamplerState) -> Hashable:
        assert isinstance(state, ComfyDPMpp2MSDEState)
        return (state.step_index, schedule_signature(state), *state.history_missing(), self.eta, self.s_noise)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """Requests of one ``batch_key``: without noise one joint elementwise update
        (``step_jointly``); with noise each request steps alone on its rows (its own tree, the
        shape it was built for), all computed before any state changes."""
        if not (self.eta > 0 and self.s_noise > 0):
            assert isinstance(states[0], ComfyDPMpp2MSDEState)
            return step_jointly(self.step, states, model_output, sample, shared=states[0].SHARED_FIELDS)
        return step_each(self.step, states, model_output, sample)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp2MSDEGpuSampler(ComfyDPMpp2MSDESampler):
    """ComfyUI's ``dpmpp_2m_sde_gpu``: the Brownian tree on the sample's device."""

    name: ClassVar[str] = "comfy_dpmpp_2m_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyDPMpp2MSDEGpu"
    tree_on_cpu: ClassVar[bool] = False


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp2MSDEHeunSampler(ComfyDPMpp2MSDESampler):
    """ComfyUI's ``dpmpp_2m_sde_heun``: the Heun form of the second-order correction."""

    name: ClassVar[str] = "comfy_dpmpp_2m_sde_heun"
    diffusers_class: ClassVar[str] = "ComfyDPMpp2MSDEHeun"
    solver_type: ClassVar[str] = "heun"


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyDPMpp2MSDEHeunGpuSampler(ComfyDPMpp2MSDEHeunSampler):
    """ComfyUI's ``dpmpp_2m_sde_heun_gpu``."""

    name: ClassVar[str] = "comfy_dpmpp_2m_sde_heun_gpu"
    diffusers_class: ClassVar[str] = "ComfyDPMpp2MSDEHeunGpu"
    tree_on_cpu: ClassVar[bool] = False
