"""Admission, one pass: resolve -> validate -> estimate -> ``Admitted``.

``admit`` is the only way a request enters an engine (rank 0's, and a pool follower's with
no ceilings); it raises, naming the field at fault, or returns an ``Admitted``:

1. **limits** (``DeployConfig.limits``), the cheapest refusal first: frames, steps and
   pixels with the model's ``GenerationDefaults`` counting for what the request leaves
   unset (what would run). A request sized by its input (an edit's image) has its pixels
   checked once the family has sized it (step 2); every ceiling is checked once.
2. **resolve + validate** (``Pipeline.admit``): the seeds drawn (once: every loop and every
   rank of a pool use them), the task, modalities, LoRAs, the family's checks and fills
   (an edit's size, a v2v's frames, a student's sigmas), the node parameters, the stages'
   own checks; plugin parameters.
3. **estimate**: every active node's ``WorkEstimate`` and the ``MemoryEstimate`` the memory
   budget reserves; a request that cannot fit even alone is refused (``DoesNotFit``).

The memory budget itself (what a running set may hold) is ``omniloop.engine.memory_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from omniloop.deploy import Limits
from omniloop.engine.errors import DoesNotFit
from omniloop.engine.limits import check_limits, check_pixels, sized_by_input
from omniloop.engine.memory_budget import MemoryBudget, MemoryEstimate
from omniloop.ext.install import check_plugin_params
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node
from omniloop.pipeline.stage import WorkEstimate
from omniloop.pipeline.state import RequestState
from omniloop.request import OmniRequest


@dataclass(frozen=True, kw_only=True)
class RequestEstimates:
    """What admission predicted for one request: each active node's ``WorkEstimate`` (node
    name -> estimate, in execution order) and the memory the budget reserves for it."""

    nodes: Mapping[str, WorkEstimate] = field(default_factory=dict)
    memory: MemoryEstimate = field(default_factory=MemoryEstimate)

    @classmethod
    def of(cls, pipeline: Pipeline, state: RequestState, nodes: list[Node]) -> "RequestEstimates":
        estimates = {node.name: node.stage.estimate(pipeline.contexts[node.name], state) for node in nodes}
        return cls(nodes=estimates, memory=MemoryEstimate.of_nodes(estimates))


@dataclass(frozen=True)
class Admitted:
    """An admitted request: ``request`` resolved (seeds fixed, the family's fills), its
    ``state`` allocated, its active ``nodes`` and its ``estimates``."""

    request: OmniRequest
    state: RequestState
    nodes: list[Node]
    estimates: RequestEstimates


def admit(pipeline: Pipeline, request: OmniRequest, *, limits: Limits | None = None,
          memory: MemoryBudget | None = None) -> Admitted:
    """The one admission pass (module docstring). ``limits`` / ``memory``: the deployment's
    ceilings and memory budget (None: not checked, a pool follower re-admitting what rank 0
    admitted). Raises ValueError (``RequestRejected``, ``LimitExceeded``) or ``DoesNotFit``."""
    if limits is not None:  # before the family's checks: the cheapest refusal first
        check_limits(request, limits, pipeline.defaults)
    state = pipeline.admit(request)
    if limits is not None and sized_by_input(request) and not sized_by_input(state.request):
        check_pixels(state.request, limits, pipeline.defaults)  # the family sized it from its input (an edit's image)
    check_plugin_params(state.request, pipeline)
    nodes = pipeline.active_nodes(state.request)
    estimates = RequestEstimates.of(pipeline, state, nodes)
    if memory is not None:
        check_fits(estimates.memory, memory)
    return Admitted(state.request, state, nodes, estimates)


def check_fits(need: MemoryEstimate, memory: MemoryBudget) -> None:
    """Refuse (DoesNotFit, a 413) a request that cannot fit even alone, naming the budget and its need."""
    for pool, (want, have) in memory.pools_short(need, alone=True).items():
        raise DoesNotFit(
            f"request needs ~{fmt_bytes(want)} of the {pool!r} cache pool but its budget is {fmt_bytes(have)}; "
            f"raise the deployment's {pool}_budget_gb, or lower the resolution, frame count or chunk size"
        )
    if not memory.fits_alone(need):
        raise DoesNotFit(
            f"request needs ~{fmt_bytes(need.alone_bytes)} (state {fmt_bytes(need.held_bytes)} + "
            f"activations {fmt_bytes(need.peak_bytes)}) but the memory budget is {fmt_bytes(memory.budget_bytes)}; "
            "lower the resolution, frame count or max_tokens"
        )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = ["Admitted", "RequestEstimates", "admit", "check_fits"]
