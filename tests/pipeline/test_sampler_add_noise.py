"""``Sampler.add_noise`` (the start of a loop from given latents) equals its diffusers
scheduler's ``add_noise`` / ``scale_noise`` at the step a strength picks, bit for bit."""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler
from omniloop.pipeline.samplers.base import start_step


def _diffusers(name: str):
    import diffusers

    if name == "flow_unipc":
        return diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    if name == "flow_euler":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.FlowMapEulerDiscreteScheduler(shift=3.0)


CONFIGS = {"flow_unipc": {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
           "flow_euler": {"shift": 3.0}, "flow_map_euler": {"shift": 3.0}}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("strength", [0.3, 0.75, 1.0])
def test_add_noise_matches_diffusers(name, strength):
    steps = 8
    ours = build_sampler(name, CONFIGS[name])
    state = ours.init_state(steps)
    start = start_step(steps, strength)
    state.step_index = start
    ref = _diffusers(name)
    ref.set_timesteps(steps)
    x0, noise = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0)).unbind(0)
    t = ref.timesteps[start:start + 1]
    expected = ref.add_noise(x0, noise, t) if hasattr(ref, "add_noise") else ref.scale_noise(x0, t, noise)
    assert torch.equal(ours.add_noise(state, x0, noise), expected)
    assert start == steps - int(steps * strength)
