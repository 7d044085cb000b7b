"""Denoise loops that start from given latents (video-to-video, SDEdit, a refine stage).

The loop builds its full schedule, skips the first steps the strength leaves out (diffusers'
``get_timesteps``: the last ``int(steps * strength)`` steps run) and noises the given
latents to the first step that runs with the sampler's own arithmetic (diffusers'
``add_noise`` / ``scale_noise``). Strength 1 on a schedule that starts at sigma 1 is pure
noise; a schedule that starts lower (a refine stage's sigmas) noises to its first sigma.
"""

from __future__ import annotations

import torch

from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.edges import InitLatents
from omniloop.pipeline.samplers.base import Sampler, SamplerState, start_step
from omniloop.request import DiffusionParams, InvalidRequest


def resolved_strength(node: float | None, request: float | None, defaults: GenerationDefaults) -> float:
    """Admission: the strength a loop node starts from given latents at: the node's own
    (``node_params``), else the request's, else the node's default, else 1."""
    strength = node if node is not None else request if request is not None else defaults.strength
    return float(strength if strength is not None else 1.0)


def admitted_strength(params: DiffusionParams, node: str) -> float:
    """A loop's strength (the node's effective params): admission has resolved it."""
    assert params.strength is not None, (f"node {node!r} starts from given latents at a strength admission resolves "
                                         "(DenoiseLoop.resolve)")
    return params.strength


def check_strength_leaves_steps(num_steps: int, strength: float, field: str) -> None:
    """Admission check: a strength so small that no step runs is refused, naming ``field``."""
    if int(num_steps * strength) == 0:
        raise InvalidRequest(
            f"{field}={strength} with {num_steps} steps runs no denoising step (int(steps * strength) = 0)",
            hint=f"pass a strength >= {1 / num_steps:.4g} or more steps", fields=(field,)
        )


def start_from_given(
    sampler: Sampler,
    samplers: dict[str, SamplerState],
    noise: dict[str, torch.Tensor],
    given: InitLatents,
    strength: float,
    *,
    node: str,
) -> int:
    """Noise ``given`` into ``noise``'s place (per modality, in place) and advance every sampler
    state to the first step that runs; returns that step. Wrong shapes or modalities are a
    ValueError naming what the loop needs."""
    missing = sorted(set(noise) - set(given.latents))
    extra = sorted(set(given.latents) - set(noise))
    if missing or extra:
        raise ValueError(f"node {node!r} starts from given latents for {sorted(noise)}; got {sorted(given.latents)}"
                         f" (pass latents for exactly these modalities)")
    for m, x in given.latents.items():
        if tuple(x.shape) != tuple(noise[m].shape):
            raise ValueError(f"initial {m} latents have shape {list(x.shape)} but this request's geometry needs "
                             f"{list(noise[m].shape)}; pass latents of that shape or change height/width/num_frames")
    start = start_step(next(iter(samplers.values())).num_steps, strength)
    for m, state in samplers.items():
        state.step_index = start
        noise[m] = sampler.add_noise(state, given.latents[m].to(device=noise[m].device, dtype=torch.float32), noise[m])
    return start
