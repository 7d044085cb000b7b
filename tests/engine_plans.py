"""The plans a real engine's scheduler makes, observed: a test that asserts on batch
composition (which requests stepped together, how large each step was, what ran in
parallel) records ``engine.scheduler.schedule``'s plans with ``record_plans`` and reads them
through ``PlanRecorder``'s accessors. The plans are the scheduler's own, returned to the
engine unchanged: nothing about scheduling is faked.

    outs, plans = run_recorded(pipeline, requests, max_batch=4)
    assert plans.batch_sizes() == [2, 2]  # both requests in each denoise step

    with record_plans(engine) as plans:  # restores the scheduler's own ``schedule`` on exit
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from omniloop.engine import Engine, EngineConfig, NodeWork, SchedulerPlan, SchedulingPolicy, StepWork
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import OmniOutput, OmniRequest
from tests.engine.conftest import run_all

PlanHook = Callable[[SchedulerPlan], None]


class PlanRecorder:
    """Every plan ``engine.scheduler.schedule`` returns, in order, in ``plans``. ``on_plan``
    (optional) sees each plan as it is made, before the engine runs it: for what is only true
    then (a loop's step count, a prefill that is still prefilling)."""

    def __init__(self, engine: Engine, on_plan: PlanHook | None = None) -> None:
        self.engine = engine  # for what the plans do not tell (its stats, its requests' state)
        self.plans: list[SchedulerPlan] = []
        self._scheduler = engine.scheduler
        self._schedule = engine.scheduler.schedule
        self._on_plan = on_plan
        # an instance attribute shadows the method until stop() deletes it
        self._scheduler.schedule = self._record  # type: ignore[method-assign]

    def _record(self) -> SchedulerPlan:
        plan = self._schedule()
        self.plans.append(plan)
        if self._on_plan is not None:
            self._on_plan(plan)
        return plan

    def stop(self) -> None:
        """The scheduler's own ``schedule`` again; the plans recorded so far stay."""
        self._scheduler.__dict__.pop("schedule", None)

    def __enter__(self) -> PlanRecorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    # -- accessors ---------------------------------------------------------------------------
    def works(self) -> list[NodeWork | StepWork]:
        """The work of every plan that had some (one-shot nodes and loop steps), in order."""
        return [p.work for p in self.plans if p.work is not None]

    def steps(self, node: str | None = None) -> list[StepWork]:
        """The loop steps (of ``node`` only, when given), in order."""
        return [p.work for p in self.plans if isinstance(p.work, StepWork) and node in (None, p.work.node)]

    def node_runs(self) -> list[NodeWork]:
        """The one-shot node runs, in order."""
        return [p.work for p in self.plans if isinstance(p.work, NodeWork)]

    def batch_sizes(self, node: str | None = None) -> list[int]:
        """How many requests each loop step (of ``node``) ran."""
        return [len(w.request_ids) for w in self.steps(node)]

    def step_groups(self, node: str | None = None) -> list[tuple[str, ...]]:
        """Which request ids stepped together, step by step (the plan's order)."""
        return [w.request_ids for w in self.steps(node)]

    def admitted(self) -> list[tuple[str, ...]]:
        """The requests each plan moved from waiting to running (plans admitting none left out)."""
        return [p.admitted for p in self.plans if p.admitted]


def record_plans(engine: Engine, on_plan: PlanHook | None = None) -> PlanRecorder:
    """Start recording ``engine``'s plans (until ``stop()`` or the end of a ``with``)."""
    return PlanRecorder(engine, on_plan)


def run_recorded(pipeline: Pipeline, requests: Iterable[OmniRequest], *, events: list[Any] | None = None,
                 **policy: Any) -> tuple[dict[str, OmniOutput], PlanRecorder]:
    """A fresh engine on ``pipeline`` with ``SchedulingPolicy(**policy)`` runs ``requests``
    (added together, before the first step) to the end under inference mode: their outputs
    by request id and its recorded plans. ``events`` collects the engine's events."""
    sink = events.append if events is not None else None
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(**policy)), event_sink=sink)
    plans = record_plans(engine)
    for request in requests:
        engine.add_request(request)
    outs, _ = run_all(engine)
    return outs, plans
