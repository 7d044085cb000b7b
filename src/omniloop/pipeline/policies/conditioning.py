"""Conditioning injectors for the loop's ``init`` (``start``), ``prepare_inputs`` and
``post_step`` slots."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.policies.noise_mask import NoiseMask
from omniloop.pipeline.samplers.base import SamplerState
from omniloop.request import InvalidRequest

Latents = dict[str, torch.Tensor]
SamplerStates = dict[str, SamplerState]


class ConditioningPolicy(Protocol):
    """The loop's ``conditioning`` slot: condition latents injected at ``init`` (``start``),
    before each forward (``prepare``) and after each step (``post_step``)."""

    @property
    def name(self) -> str: ...

    @property
    def input_port(self) -> str | None:
        """The edge it reads the condition from (None: none)."""
        ...

    @property
    def starts_from_condition(self) -> bool:
        """Whether ``start`` starts the loop from the condition (image-to-image): a request that
        feeds ``input_port`` then runs from given latents (``LoopStage.starts_from_given``)."""
        ...

    def init(self, condition: Any) -> Any: ...

    def start(self, latents: Latents, samplers: SamplerStates, state: Any, gen: torch.Generator | None,
              strength: float | None) -> tuple[Latents, SamplerStates]: ...

    def prepare(self, latents: Latents, state: Any) -> Latents: ...

    def post_step(self, latents: Latents, state: Any) -> Latents: ...

    def noise_mask(self, state: Any) -> NoiseMask | None:
        """The request's latent noise mask once ``start`` ran (None: none): the loop keeps the
        unmasked area of the given latents with it (policies/noise_mask.py)."""
        ...


@dataclass(frozen=True)
class NoConditioning:
    name: str = "conditioning"
    input_port: str | None = None
    starts_from_condition: ClassVar[bool] = False

    def init(self, condition: Any) -> Any:
        return None

    def start(self, latents: Latents, samplers: SamplerStates, state: Any, gen: torch.Generator | None,
              strength: float | None) -> tuple[Latents, SamplerStates]:
        return latents, samplers

    def prepare(self, latents: Latents, state: Any) -> Latents:
        return latents

    def post_step(self, latents: Latents, state: Any) -> Latents:
        return latents

    def noise_mask(self, state: Any) -> NoiseMask | None:
        return None


@dataclass(frozen=True)
class LatentConcat(NoConditioning):
    """Channel-concatenate clean condition latents to the noisy ones (Wan2.2 I2V:
    ``[noise(16) | mask(4) | image latents(16)]`` -> 36 input channels)."""

    modality: str = "video"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> torch.Tensor:
        if condition is None:
            raise ValueError("this model needs conditioning latents (an input image); none were produced")
        return condition.latents

    def prepare(self, latents: Latents, state: torch.Tensor) -> Latents:
        x = latents[self.modality]  # [B, C, f, h, w]
        cond = state.to(x.dtype)
        if cond.shape[0] != x.shape[0]:
            cond = cond.expand(x.shape[0], *cond.shape[1:])
        return {**latents, self.modality: torch.cat([x, cond], dim=1)}


@dataclass(frozen=True)
class LatentStart(NoConditioning):
    """Image-to-image (SDEdit): start from the condition's clean latents noised to the sigma
    ``strength`` of the way down the schedule and run only the remaining steps (diffusers'
    img2img ``get_timesteps`` + ``scale_noise``). Without a condition (text-to-image
    requests of the same pipeline) the loop starts from pure noise as usual.

    Draw order (diffusers'): with a posterior (an encoded image) its sample takes the loop's
    first normal draw and the noise the second; given latents take none and the noise is the
    first. Needs a sampler whose state is its schedule alone (flow_euler)."""

    starts_from_condition: ClassVar[bool] = True

    modality: str = "image"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> StartState | None:
        return None if condition is None else StartState(condition=condition)

    def start(self, latents: Latents, samplers: SamplerStates, state: StartState | None,
              gen: torch.Generator | None, strength: float | None) -> tuple[Latents, SamplerStates]:
        if state is None:
            return latents, samplers
        assert strength is not None, "admission resolves strength for image-to-image requests"
        condition = state.condition
        first = latents[self.modality]
        if condition.posterior is not None:
            clean = condition.posterior.sample(first)
            assert gen is not None, "image-to-image starts from the request's seeded generator (DenoiseLoop.init)"
            noise = torch.randn(first.shape, generator=gen, dtype=torch.float32).to(first.device)
        else:
            clean, noise = condition.latents.to(first.device, torch.float32), first
        if clean.shape != first.shape:
            raise InvalidRequest(f"the image's latents {tuple(clean.shape)} do not match the requested size's "
                                 f"{tuple(first.shape)}", hint="pass an image (or latents) of diffusion.height x "
                                 "diffusion.width", fields=("diffusion.height", "diffusion.width", "inputs"))
        schedule = samplers[self.modality]
        start = start_index(schedule.num_steps, strength)
        if type(schedule) is not SamplerState:
            raise InvalidRequest("diffusion.strength needs a sampler whose state is its schedule alone",
                                 hint="pass diffusion.sampler='flow_euler'", fields=("diffusion.strength", "diffusion.sampler"))
        moved = {m: dataclasses.replace(s, timesteps=s.timesteps[start:], sigmas=s.sigmas[start:], step_index=0)
                 for m, s in samplers.items()}
        sigma = schedule.sigmas[start].to(first.device)
        spec = condition.noise_mask
        if spec is not None:  # inpainting: the loop keeps the unmasked area of ``clean``
            state.mask = NoiseMask(modality=self.modality, spec=spec, clean=clean, noise=noise, mode=spec.mode)
        return {**latents, self.modality: sigma * noise + (1.0 - sigma) * clean}, moved

    def noise_mask(self, state: StartState | None) -> NoiseMask | None:
        return None if state is None else state.mask


@dataclass
class StartState:
    """LatentStart's per-request state: the condition and, for an inpainting request (a
    condition with a ``noise_mask``), the noise mask ``start`` builds."""

    condition: ConditionLatents
    mask: NoiseMask | None = None


def start_index(num_steps: int, strength: float) -> int:
    """The first step an image-to-image request runs (diffusers' ``get_timesteps``)."""
    init = min(num_steps * strength, num_steps)
    return int(max(num_steps - init, 0))

