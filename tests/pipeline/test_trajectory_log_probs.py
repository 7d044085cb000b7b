"""OutputSpec(return_trajectory=True, return_log_probs=True) through the engine on a tiny Wan
checkpoint: the ``trajectory`` artifact (latents per step, schedule, per-step log-probs), its
refusals (a deterministic sampler, named ``sampler``; NaN log-probs, named ``log_probs``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart, TrajectoryArtifact

PARAMS = dict(height=32, width=32, num_frames=5, steps=3, guidance_scale=1.0)


@pytest.fixture(scope="module")
def gen(wan_t2v_dir):
    g = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    yield g
    g.close()


def _request(seed, sampler="flow_sde", log_probs=True, **params):
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle moving right")],
                       diffusion=DiffusionParams(seed=seed, sampler=sampler, **{**PARAMS, **params}),
                       outputs=OutputSpec(modalities=["latent"], return_trajectory=True, return_log_probs=log_probs))


def test_trajectory_carries_per_step_log_probs(gen):
    out = gen.generate(_request(5))
    assert out.status.value == "completed", out.error
    traj = out.artifacts["trajectory"]
    assert isinstance(traj, TrajectoryArtifact)
    steps = 3
    assert traj.tensor.shape[0] == steps and traj.sigmas.shape == (steps + 1,) and traj.timesteps.shape == (steps,)
    assert traj.log_probs.shape == (steps,) and traj.log_prob_sums.shape == (steps,)
    assert traj.stochastic.tolist() == [True] * steps
    assert torch.equal(traj.tensor[-1], out.artifacts["latents"].latents)
    # the last step's density, recomputed here from the trajectory by the Gaussian formula: the mean
    # needs the model's velocity, which the Euler identity v = (x' - x) / dt cannot give for an SDE
    # step, so check the normalisation instead: sum = mean * numel, and a draw's density is finite
    numel = traj.start.numel()
    torch.testing.assert_close(traj.log_prob_sums, traj.log_probs * numel, rtol=1e-6, atol=0)
    assert torch.isfinite(traj.log_probs).all()
    again = gen.generate(_request(5))
    assert torch.equal(again.artifacts["trajectory"].tensor, traj.tensor)
    assert torch.equal(again.artifacts["trajectory"].log_prob_sums, traj.log_prob_sums)
    other = gen.generate(_request(6))
    assert not torch.equal(other.artifacts["trajectory"].tensor[-1], traj.tensor[-1])


def test_log_prob_matches_an_independent_gaussian_of_the_step(gen):
    """One step (steps=1) from the seed's noise: x' ~ N(mean(x, v), scale^2) with v the model's
    velocity at x, which a flow_euler run from the same seed reveals: v = (x_euler - x) / dt."""
    sde = gen.generate(_request(9, steps=1)).artifacts["trajectory"]
    ode = gen.generate(_request(9, sampler="flow_euler", log_probs=False, steps=1)).artifacts["trajectory"]
    assert torch.equal(sde.start, ode.start)  # same seed, same initial noise
    sigma, nxt = float(sde.sigmas[0]), float(sde.sigmas[1])
    dt = nxt - sigma
    x = sde.start.double()
    v = (ode.tensor[0].double() - x) / dt
    std = math.sqrt(sigma / (1 - (nxt if sigma == 1 else sigma))) * 0.7
    mean = x * (1 + std ** 2 / (2 * sigma) * dt) + v * (1 + std ** 2 * (1 - sigma) / (2 * sigma)) * dt
    density = Normal(mean, std * math.sqrt(-dt)).log_prob(sde.tensor[0].double())
    torch.testing.assert_close(sde.log_probs.double(), density.mean().reshape(1), rtol=0, atol=1e-4)


def test_log_probs_on_a_deterministic_sampler_are_refused_naming_sampler(gen):
    with pytest.raises(RequestRejected, match=r"diffusion\.sampler: sampler 'flow_euler' is deterministic") as err:
        gen.generate(_request(1, sampler="flow_euler"))
    assert err.value.fields == ("diffusion.sampler",)


def test_non_finite_log_probs_fail_the_request_naming_log_probs(gen):
    transformer = gen.pipeline.components["transformer"]
    handle = transformer.register_forward_hook(lambda m, a, out: torch.full_like(out, float("nan"))
                                               if isinstance(out, torch.Tensor) else out)
    try:
        out = gen.generate(_request(2))
    finally:
        handle.remove()
    assert out.status.value == "failed"
    assert "log_probs" in str(out.error)
    assert gen.generate(_request(2)).status.value == "completed"  # the engine goes on


def test_sde_window_and_noise_level_per_request(gen):
    req = _request(4, steps=4).model_copy(update={"node_params": {"denoise": {"sde_window": [1, 3], "noise_level": 0.5}}})
    traj = gen.generate(req).artifacts["trajectory"]
    assert traj.stochastic.tolist() == [False, True, True, False]
    assert traj.log_probs[0] == 0 and traj.log_probs[3] == 0 and (traj.log_probs[1:3] != 0).all()
    plain = gen.generate(_request(4, steps=4)).artifacts["trajectory"]
    assert not torch.equal(plain.log_probs, traj.log_probs)
    with pytest.raises(RequestRejected, match=r"node_params\['denoise'\]\.sde_window: sampler 'flow_euler' draws no SDE"):
        gen.generate(_request(4, sampler="flow_euler", log_probs=False).model_copy(
            update={"node_params": {"denoise": {"sde_window": [0, 2]}}}))
    with pytest.raises(RequestRejected, match=r"node_params\['denoise'\]\.sde_window: \[5, 6\] must be \[start, end\)"):
        gen.generate(req.model_copy(update={"node_params": {"denoise": {"sde_window": [5, 6]}}}))
