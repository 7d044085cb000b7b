"""FlowMapEulerSampler against diffusers' FlowMapEulerDiscreteScheduler (AnyFlow): schedule and
whole trajectories bit for bit (fp32 samples, float64 schedule), per-request state, batching."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMapEulerDiscreteScheduler  # noqa: E402

from omniloop.pipeline.samplers import (  # noqa: E402
    FlowMapEulerSampler,
    SchedulerConfigError,
    build_sampler,
    sampler_for_diffusers_class,
)

CONFIG = {"_class_name": "FlowMapEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 5.0}


@pytest.mark.parametrize("steps,shift,sigmas", [(4, 5.0, None), (1, 1.0, None), (3, 3.0, [1.0, 0.6, 0.2])])
def test_schedule_and_trajectory_equal_diffusers(steps, shift, sigmas):
    ref = FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    ref.set_timesteps(steps if sigmas is None else None, sigmas=sigmas)
    ours = FlowMapEulerSampler.from_config({**CONFIG, "shift": shift})
    state = ours.init_state(steps, sigmas=sigmas)
    assert state.timesteps.dtype == torch.float64 and state.sigmas.dtype == torch.float64
    assert torch.equal(state.timesteps, ref.timesteps) and torch.equal(state.sigmas, ref.sigmas)

    gen = torch.Generator().manual_seed(0)
    x_ref = x = torch.randn(1, 4, 3, 8, 8, generator=gen)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(x.shape, generator=gen)
        r = ref.sigmas[i + 1] * 1000
        assert torch.equal(state.model_timestep, torch.stack([t, r]))  # the (t, r) the model sees
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        x = ours.step(state, v, x)
        assert torch.equal(x, x_ref), (i, (x - x_ref).abs().max())
    assert state.done


def test_batched_step_equals_per_request_steps():
    sampler = build_sampler("flow_map_euler", CONFIG)
    states = [sampler.init_state(4) for _ in range(3)]
    alone = [sampler.init_state(4) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 4, 2, 4, 4, generator=gen) for _ in states]
    vs = [torch.randn(1, 4, 2, 4, 4, generator=gen) for _ in states]
    assert len({sampler.batch_key(s) for s in states}) == 1
    out = sampler.step_many(states, torch.cat(vs), torch.cat(xs))
    for i, s in enumerate(alone):
        assert torch.equal(out[i : i + 1], sampler.step(s, vs[i], xs[i]))
    assert [s.step_index for s in states] == [1, 1, 1]


def test_config_is_checked_and_the_class_maps_to_the_sampler():
    assert sampler_for_diffusers_class("FlowMapEulerDiscreteScheduler") == "flow_map_euler"
    with pytest.raises(SchedulerConfigError, match="unknown FlowMapEulerDiscreteScheduler config keys"):
        FlowMapEulerSampler.from_config({**CONFIG, "use_karras_sigmas": True})
    with pytest.raises(ValueError, match="mu="):
        FlowMapEulerSampler().init_state(4, mu=0.5)
    with pytest.raises(ValueError, match="pass exactly num_steps sigmas"):
        FlowMapEulerSampler().init_state(4, sigmas=[1.0, 0.5])
