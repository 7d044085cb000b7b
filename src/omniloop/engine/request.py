"""``EngineRequest``: one request's runtime record (one object, an enum status; STYLE.md 3).

It walks its active graph nodes in order; a loop node is entered with ``init``, advanced
one ``step`` at a time by the scheduler and left with ``finalize``. Its status and its
start/finish times are its ``RequestState``'s (one owner; read here through properties).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from omniloop.engine.admission import RequestEstimates
from omniloop.engine.memory_budget import MemoryEstimate
from omniloop.pipeline.spec import Node
from omniloop.pipeline.state import LoopState, RequestState
from omniloop.request import Failure, OmniRequest, RequestStatus


@dataclass(eq=False)
class EngineRequest:
    request: OmniRequest
    state: RequestState
    nodes: list[Node]  # active nodes, in execution order
    arrival: float = field(default_factory=time.perf_counter)
    node_index: int = 0
    loop: LoopState | None = None  # live loop of the current node (after init)
    abort_requested: bool = False
    abort_reason: str | None = None  # the cancelled output's error when not "cancelled by request"
    paused: bool = False  # held by its caller (a live session nobody watches): none of its steps run
    failure: Failure | None = None  # set when its event consumer failed: fail (not cancel) at the boundary
    attempts: int = 0  # pool restarts this request has been re-queued through
    predicted_total_s: float = 0.0
    actual_s: float = 0.0  # measured compute seconds spent on this request
    estimates: RequestEstimates = field(default_factory=RequestEstimates)  # admission's (per node; memory)
    # (steps_done, perf_counter) of the current loop's last crash checkpoint or start; None:
    # the loop is not checkpointed (engine/checkpoints.py)
    checkpoint_mark: tuple[int, float] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def memory(self) -> MemoryEstimate:
        """What the memory budget reserves for this request (admission's estimate)."""
        return self.estimates.memory

    @property
    def status(self) -> RequestStatus:
        return self.state.status

    @property
    def started(self) -> float | None:
        return self.state.started_at

    @property
    def finished(self) -> float | None:
        return self.state.finished_at

    @property
    def node(self) -> Node | None:
        return self.nodes[self.node_index] if self.node_index < len(self.nodes) else None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def advance_node(self) -> None:
        self.node_index += 1
        self.loop = None
        self.checkpoint_mark = None

    def reset(self) -> None:
        """Back to the start (pool restart re-queue): nothing computed survives."""
        self.node_index = 0
        self.loop = None
        self.state.artifacts.clear()
        self.state.loops.clear()
        self.state.requeue()
