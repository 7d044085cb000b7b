"""The sampler contract: a stateless solver object plus a per-request state.

A sampler object is built once from a checkpoint's scheduler config and shared by every
request of a deployment. Everything that changes while sampling (timesteps, sigmas, the
step index, multistep history) lives in a :class:`SamplerState` created by
``init_state`` and owned by the request's ``LoopState`` (diffusers keeps it on the
scheduler object, which breaks as soon as two requests interleave).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

import torch


@dataclass(kw_only=True)
class SamplerState:
    """Per-request sampler state. Subclasses add solver history."""

    timesteps: torch.Tensor  # [num_steps] model-facing timesteps (sigma * num_train_timesteps)
    sigmas: torch.Tensor  # [num_steps + 1] float32 noise levels, last is the terminal sigma
    step_index: int = 0

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step_index]

    @property
    def sigma(self) -> torch.Tensor:
        return self.sigmas[self.step_index]


class Sampler(Protocol):
    """One file per sampler implements this (STYLE.md 9)."""

    name: ClassVar[str]
    num_train_timesteps: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Sampler":
        """Validate a diffusers scheduler config; raise SchedulerConfigError saying why it
        cannot be honored (e.g. karras sigmas on a flow model)."""
        ...

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
    ) -> SamplerState:
        """Build the schedule for one request. ``shift`` overrides the config's flow shift;
        ``sigmas`` (descending, in (0, 1]) replaces the computed schedule."""
        ...

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Advance ``sample`` by one step using ``model_output`` (flow/velocity prediction);
        mutates ``state`` and returns the new sample."""
        ...


SAMPLERS: dict[str, type] = {}


def register_sampler(cls: type) -> type:
    SAMPLERS[cls.name] = cls
    return cls


def sampler_names() -> list[str]:
    return sorted(SAMPLERS)


class SchedulerConfigError(ValueError):
    """A checkpoint's scheduler config that a sampler cannot honor (raised at load time)."""


def build_sampler(name: str, config: dict[str, Any] | None = None) -> Sampler:
    """Build the sampler ``name`` from a (diffusers-format) scheduler config dict."""
    try:
        cls = SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; pass one of {sampler_names()}") from None
    return cls.from_config(dict(config or {}))
