"""Flow shift: the request's shift, else a per-resolution table, else the checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

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

    @classmethod
    def from_mapping(cls, table: Mapping[int, float], default: float | None = None) -> "FlowShift":
        return cls(default=default, table=tuple(sorted(table.items())))
