"""What crosses between rank 0 and the other ranks of an SPMD pool (STYLE.md 1: typed
objects, nothing else). Rank 0 sends one :class:`PlanMessage` per scheduler iteration and
every rank answers with a :class:`RankOutcome`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from omniloop.engine.scheduler import SchedulerPlan, StepScheduler
from omniloop.request import Failure, OmniRequest


@dataclass(frozen=True)
class PlanMessage:
    """One iteration for the other ranks: the frozen plan rank 0's StepScheduler decided,
    the requests it admits (validated, seeded), and the requests rank 0 ended as failed
    since the last plan (the SPMD-consistent abort of a request-fatal error; cancellations
    travel in ``plan.aborted``)."""

    plan: SchedulerPlan
    requests: tuple[OmniRequest, ...] = ()
    failed: tuple[tuple[str, Failure], ...] = ()  # (request_id, why)
    check: bool = False  # debug: hash the plan with the state it acts on (ParallelSpec.check_plans)


@dataclass(frozen=True)
class Query:
    """A read-only question to every rank (``"plugin_metrics"``)."""

    name: str


@dataclass(frozen=True)
class RankOutcome:
    """A rank's answer to a plan: its plan hash (debug) and the requests that ended on it."""

    rank: int
    plan_hash: str | None
    ended: tuple[tuple[str, str, Failure | None], ...] = ()  # (request_id, status, why)


@dataclass(frozen=True)
class RankReady:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    """A rank could not start or could not go on; it exits after sending this."""

    rank: int
    error: str  # the traceback


def plan_digest(plan: SchedulerPlan, scheduler: StepScheduler) -> str:
    """The plan and the state it acts on (each listed request's node and step), hashed: two
    ranks with the same digest are about to run the same computation."""
    items: list[Any] = [plan.iteration, plan.admitted, plan.aborted, plan.work]
    for rid in plan.work.request_ids if plan.work is not None else ():
        req = scheduler.running.get(rid)
        items.append((rid, None if req is None else (req.node_index, req.loop.steps_done if req.loop else None)))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]
