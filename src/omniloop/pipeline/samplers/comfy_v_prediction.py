"""ComfyUI's k-diffusion samplers on a continuous v-prediction model over EDM-style sigmas
(Stable Audio Open): ``euler``, ``dpmpp_2m``, ``dpmpp_2m_sde(_gpu)``, ``dpmpp_3m_sde(_gpu)`` with
the ``simple`` / ``normal`` / ``sgm_uniform`` / ``karras`` / ``exponential`` schedulers.

ComfyUI (read for behaviour; this code is ours) runs Stable Audio as ``V_PREDICTION_CONTINUOUS``:
its model sampling is ``ModelSamplingContinuousV`` over ``StableAudio``'s settings (sigma_min 0.03,
sigma_max 500, sigma_data 1) with the ``V_PREDICTION`` wrapper:

    training sigmas  exp(linspace(log sigma_min, log sigma_max, 1000))    [1000] float32, ascending
    model input      x / (sigma^2 + sigma_data^2) ** 0.5                  (c_in)
    model timestep   atan(sigma) / pi * 2                                 (the DiT's t in [0, 1))
    denoised         x sigma_data^2 / (sigma^2 + sigma_data^2) - v sigma sigma_data / (sigma^2 + sigma_data^2) ** 0.5
    start            noise * sqrt(1 + sigma_0^2) (a schedule from sigma_max, to 1e-5; else noise * sigma_0)

The samplers are the flow files' updates (``comfy_dpmpp_2m``, ``comfy_dpmpp_2m_sde``,
``comfy_dpmpp_3m_sde``) with this wrapper in place of CONST's and the half log-SNR ``-log sigma``
(no first-sigma offset: ComfyUI offsets for CONST only); ``euler`` is k-diffusion's
``x + (x - denoised) / sigma * (sigma' - sigma)``. The schedule is the sampler's ``scheduler``
(a request knob: a workflow's KSampler scheduler), computed as ComfyUI's ``calculate_sigmas`` does
on this model sampling. Equal to ComfyUI's own code to the bit on the CPU
(tests/workflows/golden/comfy_v_samplers.json, scripts/comfy_samplers_golden.py).

NOTE: one file for the six registrations: each is a flow sampler of its own file with this
model wrapper mixed in (``ComfyVSampling``); only ``euler``'s three-line update is new here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from omniloop.pipeline.samplers.base import (SamplerState, ScheduleStepBatching, SchedulerConfigError,
                                             check_config_keys, register_sampler)
from omniloop.pipeline.samplers.comfy_dpmpp_2m import ComfyDPMpp2MSampler, ComfyDPMpp2MState
from omniloop.pipeline.samplers.comfy_dpmpp_2m_sde import (ComfyDPMpp2MSDEGpuSampler, ComfyDPMpp2MSDESampler,
                                                           ComfyDPMpp2MSDEState)
from omniloop.pipeline.samplers.comfy_dpmpp_3m_sde import (ComfyDPMpp3MSDEGpuSampler, ComfyDPMpp3MSDESampler,
                                                           ComfyDPMpp3MSDEState)
from omniloop.pipeline.samplers.comfy_sde import seed_or_draw, ve_half_log_snr

V_SCHEDULERS = ("simple", "normal", "sgm_uniform", "karras", "exponential")
TRAIN_SIGMAS = 1000  # ModelSamplingContinuousEDM's table
KARRAS_RHO = 7.0
_FIELDS = ("sigma_min", "sigma_max", "sigma_data", "scheduler")
_SDE_OPTIONS = ("eta", "s_noise")


def comfy_v_sigmas(scheduler: str, steps: int, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """[steps + 1] float32 CPU: what ComfyUI's ``calculate_sigmas(model_sampling, scheduler, steps)``
    gives a ``ModelSamplingContinuousV(sigma_min, sigma_max)`` model, descending, ending with 0."""
    if scheduler not in V_SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r}: pass one of {list(V_SCHEDULERS)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    table = torch.linspace(math.log(sigma_min), math.log(sigma_max), TRAIN_SIGMAS).exp()  # [1000] float32
    lo, hi = float(table[0]), float(table[-1])  # the model sampling's sigma_min / sigma_max
    zero = torch.zeros(1)
    if scheduler == "karras":  # use_ms=False: the range as Python floats
        ramp = torch.linspace(0, 1, steps)
        min_inv, max_inv = lo ** (1 / KARRAS_RHO), hi ** (1 / KARRAS_RHO)
        return torch.cat([(max_inv + ramp * (min_inv - max_inv)) ** KARRAS_RHO, zero])
    if scheduler == "exponential":
        return torch.cat([torch.linspace(math.log(hi), math.log(lo), steps).exp(), zero])
    if scheduler == "simple":
        stride = len(table) / steps
        return torch.tensor([float(table[-(1 + int(x * stride))]) for x in range(steps)] + [0.0])
    start, end = _timestep(table[-1]), _timestep(table[0])  # normal / sgm_uniform: evenly in timestep
    # (sigma(end) is sigma_min > 0: ComfyUI's "ends at zero" case does not arise on this model)
    timesteps = torch.linspace(start, end, steps + 1)[:-1] if scheduler == "sgm_uniform" else \
        torch.linspace(start, end, steps)
    return torch.tensor([float((t * math.pi / 2).tan()) for t in timesteps] + [0.0])


def _timestep(sigma: torch.Tensor) -> torch.Tensor:
    return sigma.atan() / math.pi * 2  # ModelSamplingContinuousV.timestep


@dataclass(frozen=True, kw_only=True)
class ComfyVSampling:
    """ComfyUI's ``ModelSamplingContinuousV`` + ``V_PREDICTION`` as a sampler's model wrapper and
    schedule (mixed in before a flow sampler, whose update then runs on these)."""

    name: ClassVar[str]
    diffusers_class: ClassVar[str]
    request_knobs: ClassVar[tuple[str, ...]] = ("scheduler",)

    sigma_min: float = 0.03  # comfy/supported_models.py StableAudio.sampling_settings
    sigma_max: float = 500.0
    sigma_data: float = 1.0
    scheduler: str = "exponential"

    def __post_init__(self) -> None:
        if not 0 < self.sigma_min < self.sigma_max:
            raise SchedulerConfigError(f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}: need 0 < min < max")
        if self.sigma_data <= 0:
            raise SchedulerConfigError(f"sigma_data must be > 0, got {self.sigma_data}")
        if self.scheduler not in V_SCHEDULERS:
            raise SchedulerConfigError(f"scheduler={self.scheduler!r}: pass one of {list(V_SCHEDULERS)}")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        """``sigma_min`` / ``sigma_max`` / ``sigma_data`` (ComfyUI's sampling settings), ``scheduler``,
        and the sampler's ``eta`` / ``s_noise`` where it has them."""
        known = (*_FIELDS, *(o for o in _SDE_OPTIONS if o in cls.__dataclass_fields__))
        check_config_keys({"_class_name": cls.diffusers_class, **config}, diffusers_class=cls.diffusers_class,
                          known=known)
        return cls(**{key: config[key] for key in known if key in config})

    def v_sigmas(self, num_steps: int, shift: float | None, sigmas: Sequence[float] | None,
                 mu: float | None) -> torch.Tensor:
        if shift is not None or sigmas is not None or mu is not None:
            raise ValueError(f"{self.name} takes its sigmas from its scheduler; drop shift, sigmas and mu")
        return comfy_v_sigmas(self.scheduler, num_steps, self.sigma_min, self.sigma_max)

    def v_timesteps(self, sigmas: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
        return _timestep(sigmas[:-1]).to(device)  # [num_steps] float32: what the DiT is conditioned on

    @property
    def init_noise_sigma(self) -> float:
        """``EPS.noise_scaling`` of the start from noise, float32: ``sqrt(1 + sigma_0^2)`` where the
        schedule starts at the model's sigma_max (``Sampler.max_denoise``: within 1e-5), else
        ``sigma_0``; ``sigma_0`` is the scheduler's first sigma (the same at every step count).
        NOTE: ``normal`` / ``sgm_uniform`` round-trip sigma_max through atan / tan and start 2.6e-5
        below it: ComfyUI then scales by sigma_0 alone, and so do we."""
        first = comfy_v_sigmas(self.scheduler, 1, self.sigma_min, self.sigma_max)[0]
        top = float(torch.linspace(math.log(self.sigma_min), math.log(self.sigma_max), TRAIN_SIGMAS).exp()[-1])
        if math.isclose(top, float(first), rel_tol=1e-05) or float(first) > top:
            return float(torch.sqrt(1.0 + first ** 2.0))
        return float(first)

    def scale_model_input(self, state: SamplerState, sample: torch.Tensor) -> torch.Tensor:
        sigma = state.sigmas[state.step_index]
        return sample / (sigma ** 2 + self.sigma_data ** 2) ** 0.5  # V_PREDICTION.calculate_input

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``EPS.noise_scaling`` from given latents (not at sigma_max): ``noise * sigma + latents``."""
        sigma = state.sigmas[state.step_index].to(device=original.device, dtype=original.dtype)
        return noise * sigma + original

    def _denoised(self, x: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sd = self.sigma_data  # V_PREDICTION.calculate_denoised, in its order of operations
        return x * sd ** 2 / (sigma ** 2 + sd ** 2) - model_output * sigma * sd / (sigma ** 2 + sd ** 2) ** 0.5

    @staticmethod
    def _lambda(sigma: torch.Tensor) -> torch.Tensor:
        return ve_half_log_snr(sigma)  # sigma_to_half_log_snr of a non-CONST model


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVEulerSampler(ComfyVSampling, ScheduleStepBatching):
    """ComfyUI's ``euler`` (k-diffusion ``sample_euler``, no churn) on the v-prediction model."""

    name: ClassVar[str] = "comfy_v_euler"
    diffusers_class: ClassVar[str] = "ComfyVEuler"
    num_train_timesteps: int = 1000  # (the cosine DPM-solver's: timesteps are in [0, 1) all the same)

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        schedule = self.v_sigmas(num_steps, shift, sigmas, mu)
        return SamplerState(timesteps=self.v_timesteps(schedule, device), sigmas=schedule)

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert not state.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
        x = sample.to(torch.float32)
        d = (x - self._denoised(x, model_output.to(torch.float32), sigma)) / sigma  # to_d
        state.step_index += 1
        return (x + d * (sigma_next - sigma)).to(model_output.dtype)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVDPMpp2MSampler(ComfyVSampling, ComfyDPMpp2MSampler):
    """ComfyUI's ``dpmpp_2m`` on the v-prediction model."""

    name: ClassVar[str] = "comfy_v_dpmpp_2m"
    diffusers_class: ClassVar[str] = "ComfyVDPMpp2M"
    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        schedule = self.v_sigmas(num_steps, shift, sigmas, mu)
        return ComfyDPMpp2MState(timesteps=self.v_timesteps(schedule, device), sigmas=schedule)


class _VSDEState:
    """The SDE samplers' state from the V schedule: the tree spans the schedule itself (no offset)."""

    @staticmethod
    def build(sampler: ComfyVSampling, cls: type, num_steps: int, device: torch.device | str | None,
              shift: float | None, sigmas: Sequence[float] | None, mu: float | None, seed: int | None) -> Any:
        schedule = sampler.v_sigmas(num_steps, shift, sigmas, mu)
        return cls(timesteps=sampler.v_timesteps(schedule, device), sigmas=schedule, seed=seed_or_draw(seed),
                   top_sigma=float(schedule[0]))


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVDPMpp2MSDESampler(ComfyVSampling, ComfyDPMpp2MSDESampler):
    """ComfyUI's ``dpmpp_2m_sde`` (midpoint, the Brownian tree on the CPU) on the v-prediction model."""

    name: ClassVar[str] = "comfy_v_dpmpp_2m_sde"
    diffusers_class: ClassVar[str] = "ComfyVDPMpp2MSDE"
    request_knobs: ClassVar[tuple[str, ...]] = ("scheduler", *_SDE_OPTIONS)
    def __post_init__(self) -> None:
        ComfyVSampling.__post_init__(self)
        ComfyDPMpp2MSDESampler.__post_init__(self)

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        return _VSDEState.build(self, ComfyDPMpp2MSDEState, num_steps, device, shift, sigmas, mu, seed)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVDPMpp2MSDEGpuSampler(ComfyVDPMpp2MSDESampler):
    name: ClassVar[str] = "comfy_v_dpmpp_2m_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyVDPMpp2MSDEGpu"
    tree_on_cpu: ClassVar[bool] = ComfyDPMpp2MSDEGpuSampler.tree_on_cpu


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVDPMpp3MSDESampler(ComfyVSampling, ComfyDPMpp3MSDESampler):
    """ComfyUI's ``dpmpp_3m_sde`` (the Brownian tree on the CPU) on the v-prediction model."""

    name: ClassVar[str] = "comfy_v_dpmpp_3m_sde"
    diffusers_class: ClassVar[str] = "ComfyVDPMpp3MSDE"
    request_knobs: ClassVar[tuple[str, ...]] = ("scheduler", *_SDE_OPTIONS)
    def __post_init__(self) -> None:
        ComfyVSampling.__post_init__(self)
        ComfyDPMpp3MSDESampler.__post_init__(self)

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        return _VSDEState.build(self, ComfyDPMpp3MSDEState, num_steps, device, shift, sigmas, mu, seed)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyVDPMpp3MSDEGpuSampler(ComfyVDPMpp3MSDESampler):
    name: ClassVar[str] = "comfy_v_dpmpp_3m_sde_gpu"
    diffusers_class: ClassVar[str] = "ComfyVDPMpp3MSDEGpu"
    tree_on_cpu: ClassVar[bool] = ComfyDPMpp3MSDEGpuSampler.tree_on_cpu


COMFY_V_SAMPLERS: dict[str, str] = {  # ComfyUI's sampler_name -> ours on a v-prediction EDM-sigma model
    "euler": ComfyVEulerSampler.name, "dpmpp_2m": ComfyVDPMpp2MSampler.name,
    "dpmpp_2m_sde": ComfyVDPMpp2MSDESampler.name, "dpmpp_2m_sde_gpu": ComfyVDPMpp2MSDEGpuSampler.name,
    "dpmpp_3m_sde": ComfyVDPMpp3MSDESampler.name, "dpmpp_3m_sde_gpu": ComfyVDPMpp3MSDEGpuSampler.name}

