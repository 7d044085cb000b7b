"""The cosine DPM-solver (Stable Audio Open's SDE sampler) against diffusers'
CosineDPMSolverMultistepScheduler: schedule, input scaling and whole stochastic
trajectories (Brownian noise from the same seed), bit for bit on the CPU."""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler, sampler_for_diffusers_class
from omniloop.pipeline.samplers.base import SchedulerConfigError

CONFIG = {"sigma_min": 0.3, "sigma_max": 500.0, "sigma_data": 1.0, "solver_order": 2,
          "prediction_type": "v_prediction", "final_sigmas_type": "zero"}


def _model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A fixed nonlinear stand-in for the network's v prediction."""
    return torch.tanh(x * 0.7 + t) - 0.1 * x


@pytest.mark.parametrize("steps", [1, 4, 20])
@pytest.mark.parametrize("schedule,solver", [("exponential", "midpoint"), ("karras", "heun")])
def test_trajectory_matches_diffusers(steps, schedule, solver):
    from diffusers import CosineDPMSolverMultistepScheduler

    cfg = {**CONFIG, "sigma_schedule": schedule, "solver_type": solver}
    ref = CosineDPMSolverMultistepScheduler(**cfg)
    ref.set_timesteps(steps)
    ours = build_sampler("cosine_dpmsolver", cfg)
    state = ours.init_state(steps, seed=1234)
    assert torch.equal(state.timesteps, ref.timesteps) and torch.equal(state.sigmas, ref.sigmas)

    x0 = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0)) * ours.init_noise_sigma
    assert ours.init_noise_sigma == ref.init_noise_sigma
    x_ref, x_ours = x0.clone(), x0.clone()
    gen = torch.Generator().manual_seed(1234)
    for t in ref.timesteps:
        out_ref = _model(ref.scale_model_input(x_ref, t), t)
        x_ref = ref.step(out_ref, t, x_ref, generator=gen).prev_sample
        out = _model(ours.scale_model_input(state, x_ours), state.timestep)
        x_ours = ours.step(state, out, x_ours)
    assert state.done
    assert torch.equal(x_ours, x_ref)


def test_stochastic_noise_is_per_request_and_seeded():
    ours = build_sampler("cosine_dpmsolver", CONFIG)
    x = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(0))
    runs = []
    for seed in (7, 7, 8):
        state = ours.init_state(3, seed=seed)
        runs.append(ours.step(state, torch.zeros_like(x), x))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_config_is_checked_at_load():
    assert sampler_for_diffusers_class("CosineDPMSolverMultistepScheduler") == "cosine_dpmsolver"
    with pytest.raises(SchedulerConfigError, match="prediction_type='sample': pass 'v_prediction' or 'epsilon'"):
        build_sampler("cosine_dpmsolver", {**CONFIG, "prediction_type": "sample"})
    with pytest.raises(SchedulerConfigError, match=r"unknown CosineDPMSolverMultistepScheduler config keys \['shift'\]"):
        build_sampler("cosine_dpmsolver", {**CONFIG, "shift": 3.0})
    with pytest.raises(ValueError, match="drop shift and sigmas"):
        build_sampler("cosine_dpmsolver", CONFIG).init_state(4, shift=2.0)
