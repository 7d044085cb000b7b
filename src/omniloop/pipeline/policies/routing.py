"""Expert routing: which transformer (and which guidance scale set) runs a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Route:
    component: str  # component name of the model to run
    scale_set: str  # "primary" or "secondary" guidance scales


class RoutingPolicy(Protocol):
    """The loop's ``routing`` slot: which model runs each step."""

    @property
    def name(self) -> str: ...

    def components(self) -> tuple[str, ...]:
        """Every model component a step may route to (the loop binds them all)."""
        ...

    def route(self, timestep: torch.Tensor, num_train_timesteps: int) -> Route:
        """The model and guidance scale set of the step at ``timestep``."""
        ...


@dataclass(frozen=True)
class SingleModel:
    component: str = "transformer"
    name: str = "routing"

    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def route(self, timestep: torch.Tensor, num_train_timesteps: int) -> Route:
        return Route(self.component, "primary")


@dataclass(frozen=True)
class BoundaryTimestepRouting:
    """Wan2.2's two experts: ``high`` for t >= boundary_ratio * T, ``low`` below it.

    The low-noise expert uses the secondary guidance scale (``guidance_scale_2``).
    """

    boundary_ratio: float
    high: str = "transformer"
    low: str = "transformer_2"
    name: str = "routing"

    def __post_init__(self) -> None:
        if not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {self.boundary_ratio}")

    def components(self) -> tuple[str, ...]:
        return (self.high, self.low)

    def route(self, timestep: torch.Tensor, num_train_timesteps: int) -> Route:
        boundary = self.boundary_ratio * num_train_timesteps
        if float(timestep) >= boundary:
            return Route(self.high, "primary")
        return Route(self.low, "secondary")

