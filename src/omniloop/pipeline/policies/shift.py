"""Flow shift: how a request's sampler schedule is shifted.

``FlowShift`` (static): the request's shift, else a per-resolution table, else the
checkpoint's. ``DynamicShift`` (Flux): ``mu`` from the image's token count (diffusers'
``calculate_shift``) with diffusers' default sigmas ``linspace(1, 1/n, n)``.
Both turn a request into the keyword arguments of ``Sampler.init_state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from omniloop.request import DiffusionParams


@dataclass(frozen=True)
class FlowShift:
    """``table`` maps a max token area (latent h*w) to a shift; the first entry whose
    area is >= the request's wins. ``None`` means "use the sampler config's shift"."""

    default: float | None = None
    table: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    name: str = "shift"

    def resolve(self, params: DiffusionParams, latent_area: int | None = None) -> float | None:
        if params.shift is not None:
            return params.shift
        if latent_area is not None:
            for max_area, shift in sorted(self.table):
                if latent_area <= max_area:
                    return shift
        return self.default

    def sampler_kwargs(self, params: DiffusionParams, latent_area: int | None, num_steps: int,
                       sampler: Any) -> dict[str, Any]:
        return {"shift": self.resolve(params, latent_area), "sigmas": params.sigmas}

    @classmethod
    def from_mapping(cls, table: Mapping[int, float], default: float | None = None) -> "FlowShift":
        return cls(default=default, table=tuple(sorted(table.items())))


@dataclass(frozen=True)
class DynamicShift:
    """Resolution-dependent shift for a sampler configured with ``use_dynamic_shifting``:
    ``mu = sampler.mu_for_seq_len(tokens)`` with ``tokens = latent h*w / patch**2`` (the
    packed image sequence), and the request's sigmas or ``linspace(1, 1/n, n)``."""

    patch: int = 2
    name: str = "shift"

    def sampler_kwargs(self, params: DiffusionParams, latent_area: int | None, num_steps: int,
                       sampler: Any) -> dict[str, Any]:
        assert latent_area is not None, "DynamicShift needs image latents"
        assert params.shift is None, "admission refuses diffusion.shift for dynamically shifted models"
        sigmas = params.sigmas if params.sigmas is not None else np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        if not sampler.use_dynamic_shifting:  # e.g. FLUX.1-schnell: the config's static shift
            return {"shift": None, "sigmas": sigmas}
        return {"mu": sampler.mu_for_seq_len(latent_area // (self.patch * self.patch)), "sigmas": sigmas}


ShiftPolicy = FlowShift | DynamicShift
