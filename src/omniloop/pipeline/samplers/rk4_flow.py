"""Flow-matching RK4 (the 3/8 rule) on a "sway" time grid: Qwen2.5-Omni token2wav's ODE solver.

Reproduces transformers' ``RungeKutta4ODESolver.integrate`` over the time points of
``Qwen2_5OmniToken2WavDiTModel.sample`` bit for bit on the CPU: ``n`` points
``t = linspace(0, 1, n)`` (t = 0 is noise, 1 is data), swayed by
``t += sway * (cos(pi/2 t) - 1 + t)``, and per interval ``[t0, t1]`` (h = t1 - t0)::

    k1 = v(t0, x0)
    k2 = v(t0 + h/3,  x0 + h k1 / 3)
    k3 = v(t0 + 2h/3, x0 + h (k2 - k1/3))
    k4 = v(t1,        x0 + h (k1 - k2 + k3))
    x1 = x0 + (k1 + 3 (k2 + k3) + k4) h / 8

Each velocity evaluation is one step of the denoise loop (so the runtime owns every model
call, as for the one-evaluation samplers): ``init_state(n)`` makes ``4 (n - 1)`` steps whose
``timesteps`` are the evaluation times; ``step`` stores the stage's slope and returns the
next evaluation point (after the fourth, the next interval's start). The stage slopes and
the interval start live in the per-request :class:`RK4FlowState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerBase, SamplerState, SchedulerConfigError, check_config_keys, register_sampler
from omniloop.pipeline.samplers.joint_step import RowParts, step_jointly

_ONE_THIRD, _TWO_THIRDS = 1 / 3, 2 / 3


@dataclass(kw_only=True)
class RK4FlowState(SamplerState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("start", "slopes")  # the request's own rows
    steps: torch.Tensor  # [num_steps] fp32 interval length h of each evaluation's interval
    start: torch.Tensor | None = None  # the interval's start value x0
    slopes: list[torch.Tensor] = field(default_factory=list)  # k1.. of the current interval


def sway_time_points(num_points: int, sway: float | None, device: torch.device | str | None = None) -> torch.Tensor:
    """``[num_points]`` fp32 ODE time points, transformers' arithmetic."""
    t = torch.linspace(0, 1, num_points, device=device, dtype=torch.float32)
    if sway is not None:
        t += sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


@register_sampler
@dataclass(frozen=True, kw_only=True)
class RK4FlowSampler(SamplerBase):
    name: ClassVar[str] = "rk4_flow"
    # no diffusers scheduler: the reference is transformers' solver class of that name
    diffusers_class: ClassVar[str] = "RungeKutta4ODESolver"

    sway_coefficient: float | None = -1.0
    num_train_timesteps: int = 1  # the model takes t in [0, 1] as is

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "RK4FlowSampler":
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=("sway_coefficient",))
        sway = config.get("sway_coefficient", -1.0)
        if sway is not None and not math.isfinite(float(sway)):
            raise SchedulerConfigError(f"sway_coefficient must be a finite number or null, got {sway!r}")
        return cls(sway_coefficient=None if sway is None else float(sway))

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None, seed: int | None = None) -> RK4FlowState:
        """``num_steps``: the ODE's time points (transformers' ``num_steps``; 10 for Qwen2.5-Omni)."""
        if num_steps < 2:
            raise ValueError(f"rk4_flow integrates between time points: steps must be >= 2, got {num_steps}")
        if shift is not None or sigmas is not None or mu is not None:
            raise ValueError("rk4_flow runs the sway time grid; it takes no shift, sigmas or mu (drop diffusion.shift "
                             "and diffusion.sigmas)")
        points = sway_time_points(num_steps, self.sway_coefficient)  # CPU: per-step scalars never sync
        times, steps = [], []
        for t0, t1 in zip(points[:-1], points[1:]):
            h = t1 - t0
            times += [t0, t0 + h * _ONE_THIRD, t0 + h * _TWO_THIRDS, t1]
            steps += [h] * 4
        timesteps = torch.stack(times)  # [4 (n - 1)]
        return RK4FlowState(timesteps=timesteps.to(device), sigmas=torch.cat([1 - timesteps, torch.zeros(1)]),
                            steps=torch.stack(steps))

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, RK4FlowState), f"rk4_flow steps its own state, got {type(state).__name__}"
        assert not state.done, f"step() after the last of {state.num_steps} steps"
        stage, h = state.step_index % 4, state.steps[state.step_index].to(sample.device)
        if stage == 0:
            state.start, state.slopes = sample, []
        x0, k = state.start, [*state.slopes, model_output]
        assert x0 is not None
        if stage == 0:
            out = x0 + h * k[0] * _ONE_THIRD
        elif stage == 1:
            out = x0 + h * (k[1] - k[0] * _ONE_THIRD)
        elif stage == 2:
            out = x0 + h * (k[0] - k[1] + k[2])
        else:
            out = x0 + (k[0] + 3 * (k[1] + k[2]) + k[3]) * h / 8
            k = []
        state.slopes = k
        state.step_index += 1
        return out

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        raise ValueError("rk4_flow starts from noise only (token2wav); it does not start from given latents")

    def batch_key(self, state: SamplerState) -> Hashable | None:
        # NOTE: each request updates alone (the forward still batches), as before step_many was
        # the joint one; keying (step_index, schedule_signature) would batch the updates too
        return None

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """The states at one step of one schedule, joined (their starts and slopes) and stepped
        once: the update is elementwise with the shared ``h``."""
        return step_jointly(self.step, states, model_output, sample, shared=("step_index",))
