"""rk4_flow vs transformers' RungeKutta4ODESolver (Qwen2.5-Omni token2wav's solver): the same
time grid and the same states, bit for bit, with one velocity evaluation per loop step."""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler
from omniloop.pipeline.samplers.base import SchedulerConfigError
from omniloop.pipeline.samplers.rk4_flow import sway_time_points


def _velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A nonlinear field of time and state (a model stand-in)."""
    return torch.sin(3 * x) * (1 + t) - x * t


@pytest.mark.parametrize("num_points, sway", [(10, -1.0), (4, None), (2, 0.5)])
def test_rk4_flow_equals_transformers_solver(num_points, sway):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    x0 = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    points = torch.linspace(0, 1, num_points)
    if sway is not None:
        points += sway * (torch.cos(torch.pi / 2 * points) - 1 + points)
    expected = RungeKutta4ODESolver(function=_velocity, initial_value=x0).integrate(points)[-1]

    sampler = build_sampler("rk4_flow", {"sway_coefficient": sway})
    state = sampler.init_state(num_points)
    assert state.num_steps == 4 * (num_points - 1)  # one model call per loop step
    assert torch.equal(sway_time_points(num_points, sway), points)
    x = x0
    while not state.done:
        x = sampler.step(state, _velocity(state.timestep, x), x)
    assert torch.equal(x, expected)


def test_rk4_flow_refuses_what_it_cannot_honor():
    sampler = build_sampler("rk4_flow", {})
    with pytest.raises(ValueError, match="steps must be >= 2"):
        sampler.init_state(1)
    with pytest.raises(ValueError, match="no shift, sigmas or mu"):
        sampler.init_state(10, shift=3.0)
    with pytest.raises(SchedulerConfigError, match="unknown"):
        build_sampler("rk4_flow", {"num_steps": 10})
    with pytest.raises(ValueError, match="does not start from given latents"):
        sampler.add_noise(sampler.init_state(10), torch.zeros(1), torch.zeros(1))
