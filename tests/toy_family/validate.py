"""Toy admission checks: every bad input a ValueError naming the field and what to pass."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omniloop.pipeline.defaults import GenerationDefaults, resolve_request
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import OmniRequest, TaskType

from .presets import MAX_FRAMES, MAX_SIZE
from .stages import geometry


def make_validator(defaults: GenerationDefaults, samplers: SamplerSet, multiple: int) -> Callable[[OmniRequest], OmniRequest]:
    """``multiple``: the size step (VAE scale x patch size)."""

    def validate(request: OmniRequest) -> OmniRequest:
        request = resolve_request(request, defaults)  # what runs: the checks below are on it
        g = geometry(request)
        for name, value, most in (("height", g.height, MAX_SIZE), ("width", g.width, MAX_SIZE),
                                  ("num_frames", g.num_frames, MAX_FRAMES)):
            if value > most:
                raise ValueError(f"diffusion.{name}={value} is more than the toy model serves; pass {most} or less")
        for name, value in (("height", g.height), ("width", g.width)):
            if value % multiple:
                lo = max(multiple, value // multiple * multiple)
                raise ValueError(f"diffusion.{name}={value} must be a multiple of {multiple}; pass {lo} or {lo + multiple}")
        if request.task == TaskType.T2I and g.num_frames != 1:
            raise ValueError(f"task t2i makes one image; diffusion.num_frames must be 1 (got {g.num_frames})")
        samplers.get(request.diffusion.sampler)  # raises naming the offered samplers
        return request

    return validate
