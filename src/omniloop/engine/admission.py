"""Admission, one pass: resolve -> validate -> estimate -> ``Admitted``.

``admit`` is the only way a request enters an engine (rank 0's, and a pool follower's with
no ceilings); it raises, naming the field at fault, or returns an ``Admitted``:

0. **limits as asked** (``check_as_asked``): a request already over a ceiling with the
   model's defaults for what it leaves unset is refused before the family reads its inputs
   (the cheapest refusal first).
1. **resolve + validate** (``Pipeline.admit``): the seeds drawn (once: every loop and every
   rank of a pool use them), the task, modalities, LoRAs, the family's checks and fills
   (an edit's size, a v2v's frames, a student's sigmas), then the model's
   ``GenerationDefaults`` for the steps and geometry left unset (``resolve_request``): the
   resolved request carries every value the loops read; the node parameters, the stages'
   own checks; plugin parameters.
2. **limits** (``DeployConfig.limits``) on the resolved request: frames, pixels and steps
   as they would run (an edit's size is its image's), each loop node's ``node_params`` steps
   included (``denoise_steps``): no path around a ceiling.
3. **estimate**: every active node's ``WorkEstimate`` and the ``MemoryEstimate`` the memory
   budget reserves; a request that cannot fit even alone is refused (``DoesNotFit``).

The memory budget itself (what a running set may hold) is ``omniloop.engine.memory_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from omniloop.deploy import Limits
from omniloop.engine.errors import DoesNotFit
from omniloop.engine.limits import check_as_asked, check_limits, denoise_steps
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
    """An admitted request: ``request`` resolved (seeds fixed, the family's fills, the
    model's defaults for what it left unset), its ``state`` allocated, its active ``nodes``,
    its ``estimates`` and ``steps``: the denoising steps its first denoise loop runs (its
    ``node_params`` steps, else the request's; None: no denoise loop), what a job reports."""

    request: OmniRequest
    state: RequestState
    nodes: list[Node]
    estimates: RequestEstimates
    steps: int | None = None


def admit(pipeline: Pipeline, request: OmniRequest, *, limits: Limits | None = None,
          memory: MemoryBudget | None = None) -> Admitted:
    """The one admission pass (module docstring). ``limits`` / ``memory``: the deployment's
    ceilings and memory budget (None: not checked, a pool follower re-admitting what rank 0
    admitted). Raises ValueError (``RequestRejected``, ``LimitExceeded``) or ``DoesNotFit``."""
    if limits is not None:
        check_as_asked(request, limits, pipeline.defaults)
    state = pipeline.admit(request)
    nodes = pipeline.active_nodes(state.request)
    steps = denoise_steps(state.request, nodes, state.node_params)
    if limits is not None:  # on what would run: the resolved request and every node's own steps
        check_limits(state.request, limits, steps)
    check_plugin_params(state.request, pipeline)
    estimates = RequestEstimates.of(pipeline, state, nodes)
    if memory is not None:
        check_fits(estimates.memory, memory)
    return Admitted(state.request, state, nodes, estimates, steps=steps[0].steps if steps else None)


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
