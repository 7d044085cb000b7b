"""The ``sampler`` component: the samplers a deployment offers, built at load time.

Building (and validating) every offered sampler once at load means a bad scheduler
config fails at load, and a request naming a sampler is checked at admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omniloop.pipeline.samplers.base import Sampler


@dataclass(frozen=True)
class SamplerSet:
    default: str
    samplers: Mapping[str, Sampler]

    def __post_init__(self) -> None:
        assert self.default in self.samplers, f"default sampler {self.default!r} not in {sorted(self.samplers)}"

    def get(self, name: str | None) -> Sampler:
        if name is None:
            return self.samplers[self.default]
        try:
            return self.samplers[name]
        except KeyError:
            raise ValueError(f"diffusion.sampler {name!r} is not offered by this model; pass one of {self.names}") from None

    @property
    def names(self) -> list[str]:
        return sorted(self.samplers)

    @classmethod
    def single(cls, name: str, sampler: Any) -> "SamplerSet":
        return cls(default=name, samplers={name: sampler})
