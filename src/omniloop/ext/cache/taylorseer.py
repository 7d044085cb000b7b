"""TaylorSeer (Liu et al., "From Reusing to Forecasting", arXiv 2503.06923), order k.

:class:`TaylorState` is the forecaster: on a computed step it stores ``Y`` and its
finite-difference derivatives up to order k (divided by the step gap); on a skipped step
it evaluates the Taylor series at the elapsed steps. Same update/forecast arithmetic as
cache-dit's ``TaylorSeerState`` (including its rule that derivatives start at step 2 of
the state's own count), so DBCache+TaylorSeer matches cache-dit's calibrated DBCache.

Two uses:
* DBCache's calibrator (``taylorseer_order``): forecast the cached middle-block residual;
* :class:`TaylorSeerStep`, a step interceptor: compute every ``interval`` steps after
  ``warmup_steps`` and forecast every branch's *prediction* in between (whole-step skip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.ext.interceptors import InterceptorBase, Prediction, StepView
from omniloop.ext.plugin import Declarations, InterceptorConfig

MIN_STEPS = 8  # fewer default/requested steps: few-step (distilled) sampling, no skipping


class TaylorState:
    """Taylor forecaster of one tensor stream (one per branch / per cached residual)."""

    def __init__(self, order: int, origin: int = 0) -> None:
        self.order = order
        self.origin = origin  # step counted as 0 (derivatives start at origin + 2)
        self.current: list[torch.Tensor | None] = [None] * (order + 1)  # Y, dY, d2Y, ...
        self.last_step = origin - 1  # the last computed (non-forecast) step

    @property
    def ready(self) -> bool:
        return self.current[0] is not None

    def update(self, y: torch.Tensor, step: int) -> None:
        """Record a computed ``y`` at ``step``."""
        prev = self.current
        if prev[0] is not None and prev[0].shape != y.shape:
            prev = [None] * (self.order + 1)
        window = step - self.last_step
        new: list[torch.Tensor | None] = [None] * (self.order + 1)
        new[0] = y
        for i in range(self.order):
            before, latest = prev[i], new[i]  # latest: set, the loop stops at the first gap
            if before is None or latest is None or step - self.origin <= 1:
                break
            new[i + 1] = (latest - before) / window
        self.current = new
        self.last_step = step

    def approximate(self, step: int) -> torch.Tensor:
        """The forecast at ``step`` (after the last computed one)."""
        elapsed = step - self.last_step
        out: Any = 0
        for i, derivative in enumerate(self.current):
            if derivative is None:
                break
            out += (1 / math.factorial(i)) * derivative * (elapsed**i)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.current if t is not None)


# -- the whole-step interceptor -------------------------------------------------------------


class TaylorSeerConfig(InterceptorConfig):
    order: int = Field(default=1, ge=0, le=4, description="Taylor order k (0: reuse the last prediction)")
    warmup_steps: int = Field(default=3, ge=0, description="first steps always computed")
    interval: int = Field(default=2, ge=1, description="after warmup, compute every N-th step; forecast the others")


class TaylorSeerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    order: int | None = Field(default=None, ge=0, le=4)
    warmup_steps: int | None = Field(default=None, ge=0)
    interval: int | None = Field(default=None, ge=1)


@dataclass
class StepBranch:
    order: int
    taylor: dict[str, TaylorState] = field(default_factory=dict)  # modality -> forecaster
    calls: int = 0  # steps this branch has seen (computed or forecast)
    forecast_steps: list[int] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return bool(self.taylor) and all(t.ready for t in self.taylor.values())

    def update(self, pred: Prediction, step: int) -> None:
        for m, y in pred.items():
            self.taylor.setdefault(m, TaylorState(self.order)).update(y, step)

    def approximate(self, step: int) -> Prediction:
        return {m: t.approximate(step) for m, t in self.taylor.items()}

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.taylor.values())


def should_compute(step: int, warmup: int, interval: int) -> bool:
    """cache-dit ``TaylorSeerState.should_compute``: warmup, then every ``interval``-th step."""
    return step < warmup or (step - warmup + 1) % interval == 0


class TaylorSeerStep(InterceptorBase):
    """Whole-step forecasting: a step's branches are either all computed or forecast."""

    declarations = Declarations(
        kind="step_interceptor", graph_safe=False, distribution_altering=True, skips="step", min_steps=MIN_STEPS
    )

    def before_step(self, view: StepView) -> dict[str, Prediction] | None:
        cfg: TaylorSeerConfig = view.state.config
        out = {}
        for branch in view.branches:
            b = view.state.branch((view.component, branch), lambda: StepBranch(cfg.order))
            if b.ready and not should_compute(b.calls, cfg.warmup_steps, cfg.interval):
                out[branch] = b.approximate(b.calls)
        return out

    def after_step(self, view: StepView, preds: Mapping[str, Prediction], supplied: frozenset[str]) -> None:
        cfg: TaylorSeerConfig = view.state.config
        for branch in view.branches:
            b = view.state.branch((view.component, branch), lambda: StepBranch(cfg.order))
            if branch in supplied:
                b.forecast_steps.append(b.calls)
            else:
                b.update(preds[branch], b.calls)
            self.record(view.state, branch in supplied)
            b.calls += 1
