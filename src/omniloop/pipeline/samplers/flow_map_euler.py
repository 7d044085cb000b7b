"""Flow-map Euler: ``x_r = x_t - (sigma_t - sigma_r) * u(x_t, t, r)``.

Reproduces diffusers' ``FlowMapEulerDiscreteScheduler`` (AnyFlow): a flow-map model predicts
the *mean* velocity ``u`` over the interval ``t -> r``, so it is conditioned on both ends and
one distilled checkpoint samples at any step count. The schedule is ``linspace(1, 0, N + 1)``
(or the request's sigmas) shifted by ``shift * s / (1 + (shift - 1) s)``, with the terminal 0
appended; step ``i`` goes from ``sigmas[i]`` to ``sigmas[i + 1]``.

Precision mirrors diffusers bit for bit on the CPU: sigmas and timesteps are float64 (the
model receives float64 ``t`` and ``r`` and rounds them in its own embedding), and the update
is computed in float64, then cast to the model output's dtype.

The model-facing timestep of a step is the pair ``(t, r)``: :attr:`FlowMapState.model_timestep`
is ``[2]``, so a denoise loop hands the model ``[B, 2]`` (``t = [:, 0]``, ``r = [:, 1]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from omniloop.pipeline.samplers.base import (
    SamplerState,
    ScheduleStepBatching,
    SchedulerConfigError,
    check_config_keys,
    check_custom_sigmas,
    register_sampler,
)

_SUPPORTED_KEYS = ("num_train_timesteps", "shift")


@dataclass(kw_only=True)
class FlowMapState(SamplerState):
    """``timesteps`` [N] and ``sigmas`` [N + 1] are float64 (diffusers' dtypes)."""

    num_train_timesteps: int = 1000

    @property
    def target_timestep(self) -> torch.Tensor:
        """``r`` of the next step: ``sigmas[i + 1] * num_train_timesteps`` (float64, 0-d)."""
        return (self.sigmas[self.step_index + 1] * self.num_train_timesteps).to(self.timesteps.device)

    @property
    def model_timestep(self) -> torch.Tensor:
        """``[t, r]`` of the next step, float64 on the timesteps' device."""
        return torch.stack([self.timestep, self.target_timestep])


@register_sampler
@dataclass(frozen=True, kw_only=True)
class FlowMapEulerSampler(ScheduleStepBatching):
    """Stateless; every request's schedule and step index live in its :class:`FlowMapState`."""

    name: ClassVar[str] = "flow_map_euler"
    diffusers_class: ClassVar[str] = "FlowMapEulerDiscreteScheduler"

    num_train_timesteps: int = 1000
    shift: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 0):
            raise SchedulerConfigError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not self.shift > 0:
            raise SchedulerConfigError(f"shift must be > 0, got {self.shift!r}")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowMapEulerSampler":
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=_SUPPORTED_KEYS)
        return cls(**{key: config[key] for key in _SUPPORTED_KEYS if key in config})

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,  # a deterministic sampler draws no noise
    ) -> FlowMapState:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if mu is not None:
            raise ValueError("mu= (dynamic shifting) is not a FlowMapEulerDiscreteScheduler option; pass shift=")
        if shift is not None and not shift > 0:
            raise ValueError(f"shift must be > 0, got {shift!r}")
        shift = self.shift if shift is None else float(shift)
        if sigmas is None:
            base = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)[:-1]
        else:
            base = torch.tensor(check_custom_sigmas(sigmas, num_steps), dtype=torch.float64)
        shifted = base if shift == 1.0 else shift * base / (1 + (shift - 1) * base)
        full = torch.cat([shifted, shifted.new_zeros(1)])  # [N + 1] float64, CPU
        return FlowMapState(
            timesteps=(full[:-1] * self.num_train_timesteps).to(device),
            sigmas=full,
            num_train_timesteps=self.num_train_timesteps,
        )

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert not state.done, f"step() after the last of {state.num_steps} steps"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        # NOTE: as diffusers, the interval is a float64 tensor with the output's ndim (so it
        # promotes): the update runs in float64 and is cast to the model output's dtype.
        dt = (state.sigmas[i] - state.sigmas[i + 1]).to(sample.device).view([1] * model_output.ndim)
        prev_sample = sample - dt * model_output
        state.step_index += 1
        return prev_sample.to(model_output.dtype)

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # diffusers' scale_noise: the timestep / num_train_timesteps in the sample's dtype
        t = (state.timestep.to(device=original.device, dtype=original.dtype) / self.num_train_timesteps)
        return t * noise + (1.0 - t) * original

