"""``EngineRequest``: one request's runtime record (one object, an enum status; STYLE.md 3).

It walks its active graph nodes in order; a loop node is entered with ``init``, advanced
one ``step`` at a time by the scheduler and left with ``finalize``. Its status and its
start/finish times are its ``RequestState``'s (one owner; read here through properties).

Streaming edges (pipeline/streams.py): a consumer of a declared stream edge starts before
the request's cursor reaches it, as a *lane*: an ``EngineRequest`` of its own (``parent``: the
request; ``nodes``: the one consumer node; ``key``: its scheduler id) sharing the request's
state, so the scheduler ranks and batches its steps like any request's. When the request's
cursor reaches a node a lane runs, it takes the lane's loop over (or skips the node if the
lane finished it).
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
    parent: "EngineRequest | None" = None  # a lane: the request it runs a streaming consumer of
    lanes: dict[str, "EngineRequest"] = field(default_factory=dict)  # node -> lane running it (a request's)
    done_nodes: set[str] = field(default_factory=set)  # nodes that have finished (a request's)
    # (steps_done, perf_counter) of the current loop's last crash checkpoint or start; None:
    # the loop is not checkpointed (engine/checkpoints.py)
    checkpoint_mark: tuple[int, float] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> str:
        """The scheduler's id of this unit: the request id, or a lane's ``"<id>→<node>"``."""
        return self.request_id if self.parent is None else lane_key(self.request_id, self.nodes[0].name)

    @property
    def root(self) -> "EngineRequest":
        """The request itself (a lane's parent)."""
        return self if self.parent is None else self.parent

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

    def advance_node(self) -> "EngineRequest | None":
        """Past the current node, and past the nodes lanes have finished. Returns the lane
        whose node the cursor reached: the cursor took its loop over (the caller drops the
        lane from the scheduler)."""
        root = self.root
        if self.node is not None:
            root.done_nodes.add(self.node.name)
        self.node_index += 1
        self.loop = None
        self.checkpoint_mark = None
        if self.parent is not None:
            return None
        while self.node is not None and self.node.name in self.done_nodes:
            self.node_index += 1
        if self.node is None or self.node.name not in self.lanes:
            return None
        lane = self.lanes.pop(self.node.name)
        self.loop = lane.loop
        return lane

    def start_lane(self, node: Node) -> "EngineRequest":
        """A lane running ``node`` (a consumer of a stream edge) for this request, now."""
        assert self.parent is None and node.name not in self.lanes, f"{self.request_id}: a second lane at {node.name!r}"
        lane = EngineRequest(request=self.request, state=self.state, nodes=[node], arrival=self.arrival,
                             estimates=self.estimates, parent=self)
        self.lanes[node.name] = lane
        return lane

    def streams_ready(self) -> bool:
        """Whether the engine lets the current loop step (pipeline/streams.py): every stream
        it reads has a chunk or has ended (readiness), and no declared stream it feeds is at
        capacity (backpressure)."""
        channels = self.state.channels
        node = self.node
        if not channels or node is None or self.loop is None:
            return True
        for edge in node.stream_input_edges():
            ch = channels.get(edge)
            if ch is not None and not ch.readable:
                return False
        return not any(channels[e].full for e in node.stream_output_edges() if e in channels)

    def reset(self) -> None:
        """Back to the start (pool restart re-queue): nothing computed survives."""
        self.node_index = 0
        self.loop = None
        self.lanes.clear()
        self.done_nodes.clear()
        self.state.artifacts.clear()
        self.state.loops.clear()
        self.state.requeue()


def lane_key(request_id: str, node: str) -> str:
    """The scheduler id of the lane running ``node`` of request ``request_id``."""
    return f"{request_id}\u2192{node}"
