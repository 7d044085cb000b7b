"""Flow shift: how a request's sampler schedule is shifted.

``FlowShift`` (static): the request's shift, else a per-resolution table, else the
checkpoint's. ``DynamicShift`` (Flux, LTX-2): ``mu`` from the latents' token count
(diffusers' ``calculate_shift``) with diffusers' default sigmas ``linspace(1, 1/n, n)``.
Both turn a request and its latent shapes (modality -> shape) into the keyword arguments of
``Sampler.init_state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from omniloop.request import DiffusionParams

Shapes = Mapping[str, tuple[int, ...]]  # modality -> latent shape of one request


def latent_area(shapes: Shapes) -> int | None:
    """Latent h*w of the video (or image) latents [B, C, (F,) h, w]; None without either."""
    shape = shapes.get("video") or shapes.get("image")
    return int(shape[-1] * shape[-2]) if shape is not None else None


@runtime_checkable
class DynamicallyShifted(Protocol):
    """A sampler whose config may shift its schedule by the sequence length (diffusers'
    ``use_dynamic_shifting``) and derives ``mu`` from it (FlowEuler)."""

    use_dynamic_shifting: bool

    def mu_for_seq_len(self, image_seq_len: int) -> float: ...


class ShiftPolicy(Protocol):
    """The loop's ``shift`` slot: a request's schedule as ``Sampler.init_state`` keywords."""

    @property
    def name(self) -> str: ...

    def sampler_kwargs(self, params: DiffusionParams, shapes: Shapes, num_steps: int, sampler: Any) -> dict[str, Any]:
        """``shift`` / ``mu`` / ``sigmas`` for ``sampler.init_state`` (``shapes``: modality -> latent shape)."""
        ...


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

    def sampler_kwargs(self, params: DiffusionParams, shapes: Shapes, num_steps: int, sampler: Any) -> dict[str, Any]:
        return {"shift": self.resolve(params, latent_area(shapes)), "sigmas": params.sigmas}


@dataclass(frozen=True)
class DynamicShift:
    """Resolution-dependent shift for a sampler configured with ``use_dynamic_shifting``:
    ``mu = sampler.mu_for_seq_len(tokens)`` and the request's sigmas or ``linspace(1, 1/n, n)``.

    ``tokens`` is the packed sequence the model sees: image latents [B, C, h, w] (Flux) pack
    ``patch x patch`` latent pixels a token, h*w / patch**2; latents the loop holds packed
    already, [B, L, C] under modality ``packed`` (LTX-2's ``"video"``), have L.
    A sampler without dynamic shifting (FLUX.1-schnell's config) gets the request's static
    shift (None: the config's). NOTE: under dynamic shifting a request's ``diffusion.shift``
    has no effect (Flux's admission refuses it; LTX-2, as diffusers, takes ``mu`` only)."""

    patch: int = 2
    packed: str | None = None
    name: str = "shift"

    def tokens(self, shapes: Shapes) -> int:
        if self.packed is not None:
            return int(shapes[self.packed][1])
        area = latent_area(shapes)
        assert area is not None, "DynamicShift needs image latents (or packed=<modality>)"
        return area // (self.patch * self.patch)

    def sampler_kwargs(self, params: DiffusionParams, shapes: Shapes, num_steps: int, sampler: Any) -> dict[str, Any]:
        sigmas = params.sigmas if params.sigmas is not None else np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        if not (isinstance(sampler, DynamicallyShifted) and sampler.use_dynamic_shifting):
            return {"shift": params.shift, "sigmas": sigmas}
        return {"mu": sampler.mu_for_seq_len(self.tokens(shapes)), "sigmas": sigmas}

