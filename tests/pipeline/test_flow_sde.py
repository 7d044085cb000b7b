"""flow_sde: Flow-GRPO's flow-matching SDE step, its recorded log-probs against a Gaussian density
computed independently here (torch.distributions.Normal on Flow-GRPO's mean and std written out by
hand), seeds that replay bit for bit, batched rows equal to solo ones, and the ODE window."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from omniloop.pipeline.samplers import SchedulerConfigError, build_sampler
from omniloop.pipeline.samplers.flow_sde import step_noise_seed

SHAPE = (1, 4, 3, 5, 6)  # [B, C, F, H, W]


def _rollout(sampler, seed, velocity, steps=4, x=None):
    state = sampler.init_state(steps, seed=seed)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) if x is None else x
    xs = [x]
    for _ in range(steps):
        x = sampler.step(state, velocity(x), x)
        xs.append(x)
    return state, xs


def _velocity(x):
    return torch.tanh(x) * 0.5 - 0.1


def test_log_prob_is_the_gaussian_density_of_the_drawn_transition():
    sampler = build_sampler("flow_sde", {"shift": 3.0, "noise_level": 0.7})
    state, xs = _rollout(sampler, seed=11, velocity=_velocity)
    sigmas = state.sigmas.tolist()
    for k in range(4):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        # Flow-GRPO's sde_step_with_logprob, written out independently
        std_dev = math.sqrt(sigma / (1 - (sigmas[1] if sigma == 1 else sigma))) * 0.7
        dt = sigma_next - sigma
        x, v = xs[k].double(), _velocity(xs[k]).double()
        mean = x * (1 + std_dev ** 2 / (2 * sigma) * dt) + v * (1 + std_dev ** 2 * (1 - sigma) / (2 * sigma)) * dt
        density = Normal(mean, std_dev * math.sqrt(-dt)).log_prob(xs[k + 1].double())
        torch.testing.assert_close(state.transitions.means[k].double(), density.flatten(1).mean(1), rtol=0, atol=2e-5)
        torch.testing.assert_close(state.transitions.sums[k].double(), density.flatten(1).sum(1), rtol=1e-6, atol=0)
        assert state.transitions.stochastic[k]
        # the draw is the documented one: mean + scale * N(0, 1) from the step's own seed
        eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(step_noise_seed(11, k)))
        torch.testing.assert_close(xs[k + 1].double(), mean + std_dev * math.sqrt(-dt) * eps.double(),
                                   rtol=0, atol=1e-5)


def test_seed_replays_bit_for_bit_and_seeds_differ():
    sampler = build_sampler("flow_sde", {"shift": 5.0})
    a_state, a = _rollout(sampler, 3, _velocity)
    b_state, b = _rollout(sampler, 3, _velocity)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a_state.transitions.sums, b_state.transitions.sums))
    _, c = _rollout(sampler, 4, _velocity, x=a[0])
    assert not torch.equal(a[-1], c[-1])


def test_batched_step_equals_solo_steps():
    sampler = build_sampler("flow_sde", {"shift": 3.0})
    seeds = [1, 2, 3]
    solos = [_rollout(sampler, s, _velocity) for s in seeds]
    states = [sampler.init_state(4, seed=s) for s in seeds]
    x = torch.cat([xs[0] for _, xs in solos])
    for k in range(4):
        x = sampler.step_many(states, _velocity(x), x)
        for i, (solo_state, xs) in enumerate(solos):
            assert torch.equal(x[i:i + 1], xs[k + 1])
            assert torch.equal(states[i].transitions.sums[k], solo_state.transitions.sums[k])
            assert torch.equal(states[i].transitions.means[k], solo_state.transitions.means[k])


def test_window_takes_ode_steps_outside_it():
    sde = build_sampler("flow_sde", {"shift": 3.0, "sde_window": [1, 3]})
    euler = build_sampler("flow_euler", {"shift": 3.0})
    state, xs = _rollout(sde, 5, _velocity, steps=4)
    assert state.transitions.stochastic == [False, True, True, False]
    e_state = euler.init_state(4)
    e_state.step_index = 0
    assert torch.equal(xs[1], euler.step(e_state, _velocity(xs[0]), xs[0]))  # step 0 is Euler's, bit for bit
    e_state.step_index = 3
    assert torch.equal(xs[4], euler.step(e_state, _velocity(xs[3]), xs[3]))
    assert float(state.transitions.sums[0]) == 0.0 and float(state.transitions.sums[1]) != 0.0
    # a step's noise does not depend on the window: the windowed run's step 1 draws the full run's noise
    full = build_sampler("flow_sde", {"shift": 3.0})
    full_state = full.init_state(4, seed=5)
    full_state.step_index = 1
    assert torch.equal(full.step(full_state, _velocity(xs[1]), xs[1]), xs[2])


def test_same_schedule_as_flow_euler():
    sde = build_sampler("flow_sde", {"shift": 3.0})
    euler = build_sampler("flow_euler", {"shift": 3.0})
    assert torch.equal(sde.init_state(6, seed=0).sigmas, euler.init_state(6).sigmas)


@pytest.mark.parametrize("config, match", [
    ({"noise_level": 0.0}, "noise_level must be in"),
    ({"sde_window": [3, 2]}, "sde_window must be"),
    ({"stochastic_sampling": True}, "stochastic_sampling"),
])
def test_bad_config_is_refused(config, match):
    with pytest.raises(SchedulerConfigError, match=match):
        build_sampler("flow_sde", config)


def test_window_past_the_schedule_is_refused():
    with pytest.raises(ValueError, match="sde_window starts at step 5 but the schedule has 4 steps"):
        build_sampler("flow_sde", {"sde_window": [5, 8]}).init_state(4, seed=0)
