"""ComfyUI's ``euler_ancestral`` on a flow model: the rectified-flow ancestral step, with its noise.

ComfyUI (``comfy/k_diffusion/sampling.py``, read for behaviour; this code is ours) runs
``sample_euler_ancestral_RF`` for a CONST (flow) model. Per step ``sigma -> sigma'``, with the
model's clean estimate ``denoised = x - v * sigma``:

    sigma_down = sigma' * (1 + (sigma' / sigma - 1) * eta)
    x          = (sigma_down / sigma) * x + (1 - sigma_down / sigma) * denoised      # Euler to sigma_down
    x          = (1 - sigma') / (1 - sigma_down) * x + eps * s_noise * renoise       # back up to sigma'
    renoise    = sqrt(sigma'^2 - sigma_down^2 (1 - sigma')^2 / (1 - sigma_down)^2)

no noise when ``eta == 0`` (then it is the Euler step), and ``x = denoised`` on the last step
(``sigma' == 0``). ``eps`` is ComfyUI's ``default_noise_sampler``: one ``torch.Generator`` on
the sample's device, seeded with the prompt's seed (plus one on the CPU, as ComfyUI does),
drawing ``randn`` of the sample's shape (float32, all the request's rows at once) at every
noised step in order. So a request equals ComfyUI's run of the same seed, sigmas and model
(tests/workflows/golden/comfy_samplers.json). The schedule is ``flow_euler``'s (a workflow
hands ComfyUI's sigmas with shift 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.comfy_sde import check_noise_options, seed_or_draw
from omniloop.pipeline.samplers.flow_euler import ComfyScheduleSampler

_OPTIONS = ("eta", "s_noise")


@dataclass(kw_only=True)
class ComfyAncestralState(SamplerState):
    seed: int  # the prompt's seed: the noise generator's
    # created at the run's first step on the sample's device (a run from given latents starts later)
    generator: torch.Generator | None = None

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """The next ``eps`` of ComfyUI's ``default_noise_sampler`` for a sample ``like`` [b, ...]."""
        if self.generator is None:
            self.generator = torch.Generator(device=like.device)
            self.generator.manual_seed(self.seed + 1 if like.device.type == "cpu" else self.seed)
        return torch.randn(like.size(), dtype=torch.float32, device=like.device, generator=self.generator)


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyEulerAncestralSampler(ComfyScheduleSampler):
    """ComfyUI's ``euler_ancestral`` (``SamplerEulerAncestral``'s ``eta`` and ``s_noise``); the
    schedule fields are ``flow_euler``'s."""

    name: ClassVar[str] = "comfy_euler_ancestral"
    # NOTE: no diffusers scheduler has this update; a distinct name keeps checkpoint configs
    # mapping to flow_euler (sampler_for_diffusers_class)
    diffusers_class: ClassVar[str] = "ComfyEulerAncestral"
    options: ClassVar[tuple[str, ...]] = _OPTIONS
    request_knobs: ClassVar[tuple[str, ...]] = _OPTIONS

    eta: float = 1.0
    s_noise: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_options(self.eta, self.s_noise, "SamplerEulerAncestral")

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu)
        return ComfyAncestralState(timesteps=base.timesteps, sigmas=base.sigmas, seed=seed_or_draw(seed))

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return self.step_many([state], model_output, sample)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """Rows of each state in order, all at the same step of the same schedule (``batch_key``).
        Each request draws its own noise from its own generator (what it draws alone); a raise
        rewinds the generators and changes no state."""
        first = states[0]
        assert isinstance(first, ComfyAncestralState) and not first.done, "step() after the last step"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = first.step_index
        sigma, sigma_next = first.sigmas[i], first.sigmas[i + 1]  # 0-d float32
        x, v = sample.to(torch.float32), model_output.to(torch.float32)
        denoised = x - v * sigma  # CONST's calculate_denoised
        if sigma_next == 0:
            out = denoised
        else:
            out = self._ancestral(states, x, denoised, sigma, sigma_next)
        for state in states:
            state.step_index += 1
        return out.to(model_output.dtype)

    def _ancestral(self, states: Sequence[SamplerState], x: torch.Tensor, denoised: torch.Tensor,
                   sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        eta = self.eta
        downstep_ratio = 1 + (sigma_next / sigma - 1) * eta
        sigma_down = sigma_next * downstep_ratio
        alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
        renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        ratio = sigma_down / sigma
        x = ratio * x + (1 - ratio) * denoised
        if not eta > 0:
            return x
        with generators_rewound_on_raise(states):
            rows = x.shape[0] // len(states)
            noise = torch.cat([_own(s).noise(x[k * rows:(k + 1) * rows]) for k, s in enumerate(states)])
            return (alpha_next / alpha_down) * x + noise * self.s_noise * renoise

    def batch_key(self, state: SamplerState) -> Hashable:
        return (state.step_index, schedule_signature(state), self.eta, self.s_noise)


@contextmanager
def generators_rewound_on_raise(states: Sequence[SamplerState]) -> Iterator[None]:
    """Around a step that draws each request's noise: a raise rewinds every request's generator
    to where it stood (one created inside is dropped again), so a failed step changes no state."""
    owned = [_own(s) for s in states]
    saved = [s.generator.get_state() if s.generator is not None else None for s in owned]
    try:
        yield
    except BaseException:
        for s, before in zip(owned, saved):
            if before is None:
                s.generator = None
            elif s.generator is not None:
                s.generator.set_state(before)
        raise


def _own(state: SamplerState) -> ComfyAncestralState:
    assert isinstance(state, ComfyAncestralState), f"comfy_euler_ancestral steps its own states, got {type(state).__name__}"
    return state
