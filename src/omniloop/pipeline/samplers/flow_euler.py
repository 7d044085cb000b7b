"""Flow-matching Euler: ``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v(x_i, t_i)``.

Reproduces diffusers' ``FlowMatchEulerDiscreteScheduler`` (timesteps, sigmas and ``step``,
bit for bit on the CPU) for the deterministic subset that real image/video checkpoints use:
a static ``shift``, ``shift_terminal`` (LTX) and resolution-dependent shifting with an
explicit ``mu`` (Flux). Sigma reshaping (karras/exponential/beta), stochastic sampling and
inverted sigmas are refused at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from omniloop.pipeline.samplers.base import (
    SamplerState,
    ScheduleStepBatching,
    SchedulerConfigError,
    check_config_keys,
    check_custom_sigmas,
    register_sampler,
)

_SUPPORTED_KEYS = (
    "num_train_timesteps",
    "shift",
    "shift_terminal",
    "use_dynamic_shifting",
    "time_shift_type",
    # Read by pipelines to compute mu (see FlowEulerSampler.mu_for_seq_len), not by the schedule.
    "base_shift",
    "max_shift",
    "base_image_seq_len",
    "max_image_seq_len",
)

# Flags accepted only when false: key -> why true is refused.
_REFUSED_FLAGS = {
    "use_karras_sigmas": "Karras (rho=7) reshaping of flow sigmas is not implemented; shape the schedule with `shift` or `shift_terminal` instead",
    "use_exponential_sigmas": "exponential sigmas are not implemented for flow models; shape the schedule with `shift` or `shift_terminal` instead",
    "use_beta_sigmas": "beta sigmas are not implemented for flow models; shape the schedule with `shift` or `shift_terminal` instead",
    "stochastic_sampling": "stochastic (re-noising) sampling is not implemented; this sampler is the deterministic Euler ODE step",
    "invert_sigmas": "inverted sigma schedules (Mochi) are not implemented",
}


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Static flow shift; same expression (and numpy dtype rules) as diffusers."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_shift(sigmas: np.ndarray, mu: float, kind: str) -> np.ndarray:
    """Resolution-dependent shift (diffusers ``time_shift`` with its sigma=1.0)."""
    if kind == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
    return mu / (mu + (1 / sigmas - 1))


def stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Stretch the schedule so it ends at ``shift_terminal`` (LTX-Video)."""
    one_minus_z = 1 - sigmas
    if one_minus_z[-1] == 0:  # diffusers divides 0 by 0 here and samples NaN
        raise ValueError(
            f"shift_terminal cannot stretch a schedule that ends at sigma 1 ({sigmas.tolist()}); "
            "use at least 2 steps, or sigmas that end below 1"
        )
    scale_factor = one_minus_z[-1] / (1 - shift_terminal)
    return 1 - (one_minus_z / scale_factor)


def shift_schedule(base: np.ndarray, *, dynamic: bool, shift: float, mu: float | None, time_shift_type: str,
                   shift_terminal: float | None) -> np.ndarray:
    """diffusers' flow schedule from its unshifted base: the dynamic shift at ``mu`` (``dynamic``)
    or the static ``shift``, then the stretch to ``shift_terminal`` where one is set."""
    if dynamic:
        assert mu is not None, "resolve_shift asks for mu with dynamic shifting"
        shifted = time_shift(base, mu, time_shift_type)
    else:
        shifted = shift_sigmas(base, shift)
    return stretch_to_terminal(shifted, shift_terminal) if shift_terminal else shifted


def resolve_shift(config_shift: float, use_dynamic_shifting: bool, *, shift: float | None, mu: float | None) -> float:
    """The static shift for one request: its ``shift`` override, else the config's. Checks that
    ``mu`` is given exactly when the config shifts dynamically (then the static shift is unused)."""
    if use_dynamic_shifting:
        if mu is None:
            raise ValueError("this config sets use_dynamic_shifting; pass mu= (e.g. FlowEulerSampler.mu_for_seq_len)")
        if shift is not None:
            raise ValueError("shift= has no effect with use_dynamic_shifting; pass mu= instead")
        return config_shift
    if mu is not None:
        raise ValueError("mu= needs use_dynamic_shifting=true in the config; pass shift= instead")
    if shift is not None and not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    return config_shift if shift is None else float(shift)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class FlowEulerSampler(ScheduleStepBatching):
    """Stateless; every request's schedule and step index live in its :class:`SamplerState`."""

    name: ClassVar[str] = "flow_euler"
    diffusers_class: ClassVar[str] = "FlowMatchEulerDiscreteScheduler"

    num_train_timesteps: int = 1000
    shift: float = 1.0
    shift_terminal: float | None = None
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096

    def __post_init__(self) -> None:
        if not (isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 0):
            raise SchedulerConfigError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not self.shift > 0:
            raise SchedulerConfigError(f"shift must be > 0, got {self.shift!r}")
        if self.shift_terminal and not 0 < self.shift_terminal < 1:
            raise SchedulerConfigError(f"shift_terminal must be in (0, 1) or null, got {self.shift_terminal!r}")
        if self.time_shift_type not in ("exponential", "linear"):
            raise SchedulerConfigError(
                f"time_shift_type={self.time_shift_type!r} is not supported; set 'exponential' or 'linear'"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowEulerSampler":
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=(*_SUPPORTED_KEYS, *_REFUSED_FLAGS))
        for key, why in _REFUSED_FLAGS.items():
            if config.get(key):
                raise SchedulerConfigError(f"{key}={config[key]!r} is not supported: {why}; set {key}=false")
        return cls(**{key: config[key] for key in _SUPPORTED_KEYS if key in config})

    @classmethod
    def from_schedule_config(cls, config: dict[str, Any], options: tuple[str, ...] = ()) -> "FlowEulerSampler":
        """``cls`` over ``flow_euler``'s schedule config plus its own ``options`` (ComfyUI's
        samplers: no diffusers scheduler has their update, so their configs carry no
        ``_class_name`` and are checked under the sampler's own ``diffusers_class``)."""
        known = (*_SUPPORTED_KEYS, *options)
        check_config_keys({"_class_name": cls.diffusers_class, **config}, diffusers_class=cls.diffusers_class,
                          known=known)
        return cls(**{key: config[key] for key in known if key in config})

    def mu_for_seq_len(self, image_seq_len: int) -> float:
        """The ``mu`` diffusers pipelines (Flux ``calculate_shift``) derive from the token count."""
        if self.base_shift is None or self.max_shift is None:
            raise ValueError("this config has no base_shift/max_shift; pass mu explicitly")
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        b = self.base_shift - m * self.base_image_seq_len
        return image_seq_len * m + b

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,  # a deterministic sampler draws no noise
    ) -> SamplerState:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        shift = resolve_shift(self.shift, self.use_dynamic_shifting, shift=shift, mu=mu)
        # 1. Unshifted base schedule (float64 when computed, float32 when given, as in diffusers).
        if sigmas is None:
            sigma_max, sigma_min = self._train_sigma_range(shift)
            n = self.num_train_timesteps
            base = np.linspace(sigma_max * n, sigma_min * n, num_steps) / n
        else:
            base = np.array(check_custom_sigmas(sigmas, num_steps)).astype(np.float32)
        # 2. Shift, 3. stretch to the terminal value.
        shifted = shift_schedule(base, dynamic=self.use_dynamic_shifting, shift=shift, mu=mu,
                                 time_shift_type=self.time_shift_type, shift_terminal=self.shift_terminal)
        sigmas_t = torch.from_numpy(shifted).to(torch.float32)  # [num_steps]
        return SamplerState(
            timesteps=(sigmas_t * self.num_train_timesteps).to(device),
            sigmas=torch.cat([sigmas_t, torch.zeros(1)]),
        )

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert not state.done, f"step() after the last of {state.num_steps} steps"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        # NOTE: like diffusers, upcast the sample, then return the model output's dtype. The
        # product dt * v is taken in the model output's dtype (a 0-d tensor does not promote).
        sample = sample.to(torch.float32)
        dt = state.sigmas[i + 1] - state.sigmas[i]
        prev_sample = sample + dt * model_output
        state.step_index += 1
        return prev_sample.to(model_output.dtype)

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # diffusers' scale_noise: sigma * noise + (1 - sigma) * sample, in the sample's dtype
        sigma = state.sigmas[state.step_index].to(device=original.device, dtype=original.dtype)
        return sigma * noise + (1.0 - sigma) * original


    def _train_sigma_range(self, shift: float) -> tuple[float, float]:
        """(sigma_max, sigma_min) of the shifted training schedule, computed in float32 torch
        as diffusers' constructor does. NOTE: a request shift acts as if the config had it, so
        sigma_min moves with it (diffusers' ``set_shift`` would keep the config's sigma_min)."""
        ends = torch.tensor([self.num_train_timesteps, 1], dtype=torch.float32) / self.num_train_timesteps
        if not self.use_dynamic_shifting:
            ends = shift * ends / (1 + (shift - 1) * ends)
        return ends[0].item(), ends[1].item()


@dataclass(frozen=True, kw_only=True)
class ComfyScheduleSampler(FlowEulerSampler):
    """A ComfyUI sampler run over ``flow_euler``'s schedule (not itself registered): its config
    is that schedule's plus its own ``options`` (``from_schedule_config``)."""

    options: ClassVar[tuple[str, ...]] = ()  # its config keys beyond the schedule's

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowEulerSampler":
        return cls.from_schedule_config(config, cls.options)
