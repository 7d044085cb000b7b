"""``EngineRequest``: one request's runtime record (one object, an enum status; STYLE.md 3).

It walks its active graph nodes in order; a loop node is entered with ``init``, advanced
one ``step`` at a time by the scheduler and left with ``finalize``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omniloop.engine.admission import MemoryEstimate
from omniloop.pipeline.spec import Node
from omniloop.pipeline.state import LoopState, RequestState
from omniloop.request import OmniRequest, RequestStatus


@dataclass(eq=False)
class EngineRequest:
    request: OmniRequest
    state: RequestState
    nodes: list[Node]  # active nodes, in execution order
    arrival: float = field(default_factory=time.perf_counter)
    node_index: int = 0
    loop: LoopState | None = None  # live loop of the current node (after init)
    status: RequestStatus = RequestStatus.QUEUED
    abort_requested: bool = False
    abort_reason: str | None = None  # the cancelled output's error when not "cancelled by request"
    paused: bool = False  # held by its caller (a live session nobody watches): none of its steps run
    failure: str | None = None  # set when its event consumer failed: fail (not cancel) at the boundary
    attempts: int = 0  # pool restarts this request has been re-queued through
    started: float | None = None
    finished: float | None = None
    predicted_total_s: float = 0.0
    actual_s: float = 0.0  # measured compute seconds spent on this request
    memory: MemoryEstimate = field(default_factory=MemoryEstimate)  # admission's estimate (what it reserves)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def node(self) -> Node | None:
        return self.nodes[self.node_index] if self.node_index < len(self.nodes) else None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def advance_node(self) -> None:
        self.node_index += 1
        self.loop = None

    def reset(self) -> None:
        """Back to the start (pool restart re-queue): nothing computed survives."""
        self.node_index = 0
        self.loop = None
        self.state.artifacts.clear()
        self.state.loops.clear()
        self.status = RequestStatus.QUEUED
        self.started = None
