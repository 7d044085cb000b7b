"""StepScheduler: decides, once per iteration, which work runs next.

One-shot nodes are scheduled per request; loop steps per step. Each iteration produces
one typed ``SchedulerPlan`` — the object rank 0 would broadcast to an SPMD pool — and
preemption happens only between plans, i.e. at step boundaries. Ranking: priority, then
deadline risk, then shortest remaining predicted cost (aged, so long jobs cannot starve).

Request-level baselines (benchmarks compare against them): ``fifo`` runs requests oldest
first to completion; ``fifo_batch`` is request-level batching (what sglang's dynamic
batching does for diffusion): when nothing runs, the oldest waiting request and the waiting
requests of its exact shape and step count (up to ``max_batch``) start together and run as
one batch from start to finish; arrivals wait for the batch to end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

from omniloop.engine.memory_budget import MemoryBudget
from omniloop.engine.cost_model import CostModel, ItemCost
from omniloop.engine.fanout import ready_siblings
from omniloop.engine.request import EngineRequest
from omniloop.pipeline.stage import batches_with


@dataclass(frozen=True)
class NodeWork:
    """Run the current one-shot node, or enter (``init``) the current loop, of every listed
    request, one after the other in one iteration. Requests at the same node are grouped
    when the head of the ranking is among them: they then reach their loop together and
    its steps batch, instead of entering one per iteration and stepping in partial
    batches (measured: 1,024 rollouts on an H200 ran ~6x slower that way)."""

    node: str
    request_ids: tuple[str, ...]
    # one request only: the one-shot nodes after ``node`` whose inputs are ready too; they run
    # at the same time as it (fan-out: LTX-2's video decode || audio decode + vocoder)
    parallel: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepWork:
    """One step of ``node`` for every listed request, as one ``step_many`` batch."""

    node: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class SchedulerPlan:
    iteration: int
    admitted: tuple[str, ...] = ()  # waiting -> running this iteration
    aborted: tuple[str, ...] = ()  # dropped at this step boundary
    work: NodeWork | StepWork | None = None
    predicted_s: float = 0.0

    @property
    def empty(self) -> bool:
        return self.work is None and not self.admitted and not self.aborted


@dataclass(frozen=True)
class SchedulingPolicy:
    kind: Literal["srpt", "fifo", "fifo_batch"] = "srpt"
    max_running: int = 8  # requests holding state at once
    max_batch: int = 8  # requests per batched step
    max_batch_tokens: int | None = None  # tokens per batched step (the stages' batch_weight); None: no budget
    aging: float = 0.05  # seconds of remaining cost forgiven per second waited
    deadline_margin: float = 1.5  # a deadline is at risk when slack < margin * remaining
    prologue_share: float = 0.25  # prologue items cheaper than this share of a step run first
    fan_out: bool = True  # ready one-shot siblings of a request run together (engine/fanout.py)


@dataclass
class StepScheduler:
    cost_model: CostModel
    memory: MemoryBudget
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)
    waiting: list[EngineRequest] = field(default_factory=list)
    running: dict[str, EngineRequest] = field(default_factory=dict)
    iteration: int = 0
    hold_admission: bool = False  # no waiting request starts (a weight-plane barrier, an asleep engine)
    _last_was_step: bool = False

    # -- intake -------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def add_lane(self, lane: EngineRequest) -> None:
        """A running request's streaming consumer, started now (engine/request.py): ranked and
        batched like a request; its request's admission holds its memory."""
        assert lane.parent is not None and lane.key not in self.running, f"lane {lane.key!r} already running"
        self.running[lane.key] = lane

    def find(self, request_id: str) -> EngineRequest | None:
        return self.running.get(request_id) or next((r for r in self.waiting if r.request_id == request_id), None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + self.num_running

    @property
    def num_running(self) -> int:
        """Requests running (their lanes are not counted)."""
        return sum(1 for r in self.running.values() if r.parent is None)

    # -- the core loop: one plan per iteration ---------------------------------------------
    def schedule(self) -> SchedulerPlan:
        self.iteration += 1
        aborted = self._take_aborted()
        admitted = self._admit()
        now = time.perf_counter()
        live = [r for r in self.running.values() if not r.root.abort_requested and not r.root.paused]
        _forward_streams(live)
        ranked = self._rank([r for r in live if _ready(r) and self._ready_at(r) <= now])
        head = ranked[0] if ranked else None
        prologue = [r for r in ranked if _in_prologue(r)]
        if prologue and head is not None and head is not prologue[0] and self._prologue_first(prologue[0], head):
            head = prologue[0]
        work = self._work_for(head, ranked, group=head is ranked[0]) if head is not None else None
        # a prologue step (a prefill chunk) does not count: the next pick goes back to the head
        self._last_was_step = isinstance(work, StepWork) and head is not None and not _in_prologue(head)
        return SchedulerPlan(self.iteration, admitted, aborted, work, self._predict(work))

    def next_ready_s(self) -> float | None:
        """Seconds until a running request that waits (``LoopStage.ready_at``) becomes ready;
        0 when one is ready now (or one must be aborted), None when nothing is running, inf
        when every running request is paused (``Engine.pause``: only a resume or an abort
        wakes them)."""
        if not self.running:
            return None
        live = [r for r in self.running.values() if not r.root.paused or r.root.abort_requested]
        if not live:
            return math.inf
        now = time.perf_counter()
        return max(0.0, min(self._ready_at(r) for r in live) - now)

    # -- helpers --------------------------------------------------------------------------
    def _ready_at(self, req: EngineRequest) -> float:
        node = req.node
        if req.root.abort_requested or req.loop is None or node is None or not node.is_loop:
            return 0.0
        at = node.stage.ready_at(req.loop)
        return 0.0 if at is None else at

    def _prologue_first(self, candidate: EngineRequest, head: EngineRequest) -> bool:
        """Run another request's prologue item (encoder, loop init) before the head's step?

        Cheap prologue work (relative to the head's step) runs at once: it brings requests
        into their loops, where steps batch, at negligible delay to the head. Costly
        prologue work is interleaved, one item per head step, bounding the head's delay.
        """
        prologue_s = self.cost_model.predict(self.item_cost(candidate))
        step_s = self.cost_model.predict(self.item_cost(head))
        return prologue_s <= self.policy.prologue_share * step_s or self._last_was_step

    def _take_aborted(self) -> tuple[str, ...]:
        ids = [r.request_id for r in self.waiting if r.abort_requested]
        ids += [rid for rid, r in self.running.items() if r.abort_requested and r.parent is None]
        return tuple(ids)

    def _admit(self) -> tuple[str, ...]:
        if self.hold_admission:
            return ()
        admitted = []
        candidates = self._rank([r for r in self.waiting if not r.abort_requested])
        if self.policy.kind == "fifo_batch":
            candidates = self._request_batch(candidates)
        for req in candidates:
            if self.num_running >= self.policy.max_running:
                break
            if not self.memory.can_start(req.memory):
                break  # no room now: wait for a running request to finish (head-of-line by rank)
            self.memory.reserve(req.request_id, req.memory)
            self.waiting.remove(req)
            self.running[req.request_id] = req
            admitted.append(req.request_id)
        return tuple(admitted)

    def _request_batch(self, ranked: list[EngineRequest]) -> list[EngineRequest]:
        """``fifo_batch``: nothing while a batch runs; else the oldest request and the
        waiting ones of its shape (same nodes, step counts, FLOPs and batch groups)."""
        if self.running or not ranked:
            return []
        key = _shape_key(ranked[0])
        return [r for r in ranked if batches_with(key, _shape_key(r))][: self.policy.max_batch]

    def _rank(self, reqs: list[EngineRequest]) -> list[EngineRequest]:
        if self.policy.kind in ("fifo", "fifo_batch"):
            return sorted(reqs, key=lambda r: (r.arrival, -_depth(r)))
        now = time.perf_counter()
        return sorted(reqs, key=lambda r: self._key(r, now))

    def _key(self, req: EngineRequest, now: float) -> tuple:
        """A request and its lanes rank as one request; among them the node furthest down
        the graph goes first (a consumer drains its stream before the producer refills it:
        the first audio comes sooner and the queue stays short). Within a priority and
        deadline class, a consumer whose producer waits on the full stream between them goes
        before any other request's work: otherwise the shortest request's units lead every
        pick while the others' producers sit at capacity, so their steps (a talker's decode)
        never join the leader's batch and the requests run one after the other. A request
        whose last streaming consumer has not stepped yet ranks there too (``_first_output``:
        a new answer's thinker and talker are not starved by older answers' talkers until its
        first audio; its steps still batch with theirs)."""
        root = req.root
        remaining = self.remaining_s(root) + sum(self.remaining_s(lane) for lane in root.lanes.values())
        waited = now - req.arrival
        at_risk = 1
        if req.request.deadline_s is not None:
            slack = req.arrival + req.request.deadline_s - now
            at_risk = 0 if slack < self.policy.deadline_margin * remaining else 1
        first = _unblocks_producer(req) or _first_output(req)
        return (-req.request.priority, at_risk, not first, remaining - self.policy.aging * waited,
                req.arrival, -_depth(req))

    def _work_for(self, head: EngineRequest, ranked: list[EngineRequest], *, group: bool) -> NodeWork | StepWork:
        """``group``: the head leads the ranking, so requests at its one-shot node may join
        it (a prologue item picked ahead of the head by ``_prologue_first`` runs alone: its
        cost is bounded against the head's step)."""
        node = head.node
        assert node is not None, f"running request {head.request_id} has no node left"
        if head.loop is None or not node.is_loop:
            batch = [head]
            for other in ranked[1:] if group else ():
                if len(batch) >= self.policy.max_batch:
                    break
                if other.node is node and (other.loop is None or not node.is_loop):
                    batch.append(other)
            parallel: tuple[str, ...] = ()
            if len(batch) == 1 and self.policy.fan_out and not node.is_loop:
                parallel = tuple(n.name for n in ready_siblings(head.nodes, head.node_index))
            return NodeWork(node.name, tuple(r.key for r in batch), parallel)
        key = node.stage.batch_key(head.loop)
        batch = [head]
        budget, used = self.policy.max_batch_tokens, node.stage.batch_weight(head.loop)
        for other in ranked if key is not None else ():  # a None key runs alone: no candidates to ask
            if len(batch) >= self.policy.max_batch:
                break
            if other is head or other.node is not node or other.loop is None:  # head: a prologue step picked first
                continue
            if batches_with(key, node.stage.batch_key(other.loop)):
                weight = node.stage.batch_weight(other.loop)
                if budget is not None and used + weight > budget:
                    continue  # over the token budget: a smaller request further down may still fit
                batch.append(other)
                used += weight
        return StepWork(node.name, tuple(r.key for r in batch))

    def item_cost(self, req: EngineRequest) -> ItemCost:
        """The cost-model item of the request's next piece of work."""
        node = req.node
        assert node is not None
        if req.loop is not None and node.is_loop:
            return ItemCost(node.name, "step", node.stage.step_flops(req.loop))
        return ItemCost(node.name, "init" if node.is_loop else "node", None)

    def remaining_s(self, req: EngineRequest) -> float:
        """Predicted seconds of work left for ``req`` (estimates made at admission,
        refined by the live loop's step count and the calibrated cost model)."""
        total = 0.0
        for i in range(req.node_index, len(req.nodes)):
            node = req.nodes[i]
            if i > req.node_index and (node.name in req.lanes or node.name in req.done_nodes):
                continue  # a lane's work: its own remaining cost
            est = req.estimates.nodes[node.name]
            if node.is_loop:
                steps_left = est.steps
                if i == req.node_index and req.loop is not None:
                    steps_left = max(req.loop.steps_target - req.loop.steps_done, 0)
                total += steps_left * self.cost_model.predict(ItemCost(node.name, "step", est.flops_per_step))
            else:
                total += self.cost_model.predict(ItemCost(node.name, "node", None))
        return total

    def _predict(self, work: NodeWork | StepWork | None) -> float:
        if work is None:
            return 0.0
        return sum(self.cost_model.predict(self.item_cost(self.running[i])) for i in work.request_ids)

    def remove(self, request_id: str) -> EngineRequest | None:
        req = self.running.pop(request_id, None)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is not None:
                self.waiting.remove(req)
        self.memory.release(request_id)
        return req

    def requeue_running(self) -> list[EngineRequest]:
        """Pool restart: every running request loses its state (and its lanes) and waits again."""
        moved = [r for r in self.running.values() if r.parent is None]
        for req in moved:
            self.memory.release(req.request_id)
            req.reset()
        self.running.clear()
        self.waiting = moved + self.waiting
        return moved


def _depth(req: EngineRequest) -> int:
    """How far down its request's graph the unit's node is (a lane's consumer ranks before its producer)."""
    return req.node_index if req.parent is None else req.root.nodes.index(req.nodes[0])


def _unblocks_producer(req: EngineRequest) -> bool:
    """Whether a step of the unit's loop drains a stream its producer waits on (at capacity)."""
    node, channels = req.node, req.state.channels
    if req.loop is None or node is None or not node.is_loop or not channels:
        return False
    return any(ch is not None and ch.full for ch in map(channels.get, node.stream_input_edges()))


def _first_output(req: EngineRequest) -> bool:
    """Whether the unit's request has not yet stepped its last streaming consumer (code2wav: its
    first audio window), as vLLM runs a new request's prefill before others' decodes. Every unit
    of such a request ranks first (its thinker, its talker, its first window): an answer arriving
    while others speak is not queued behind their talker steps until they end. Bounded: true only
    until that consumer's first step; a request with no streaming consumer never. The state read
    is the request's and its loops' (``steps_done``)."""
    root = req.root
    last = next((n for n in reversed(root.nodes) if n.is_loop and n.stream_input_edges()), None)
    if last is None or last.name in root.done_nodes:
        return False
    lane = root.lanes.get(last.name)
    if lane is None and root.node is last:  # the lane was merged back into the request (its producer ended)
        lane = root
    if lane is None:
        return root.node_index <= root.nodes.index(last)  # not started yet
    return lane.loop is None or lane.loop.steps_done == 0


def _forward_streams(reqs: Sequence[EngineRequest]) -> None:
    """Before readiness is asked: each loop whose streams let it step is handed what they got
    since it last saw them (``LoopStage.forward_streams``: a loop on a role pool is sent them)."""
    for req in reqs:
        node = req.node
        if req.loop is not None and node is not None and node.is_loop and req.streams_ready():
            node.stage.forward_streams(req.loop)


def _ready(req: EngineRequest) -> bool:
    """A request inside a loop whose next step cannot run yet (waiting for KV blocks, for a
    chunk of a stream it reads, for room on a stream it feeds) is skipped. A query only."""
    node = req.node
    if req.loop is None or node is None or not node.is_loop:
        return True
    return req.streams_ready() and bool(node.stage.ready(req.loop))


def _shape_key(req: EngineRequest) -> tuple:
    """Requests with equal keys do the same work (nodes, step counts, FLOPs, the batch keys
    their steps are predicted to have): they can run as one batch start to finish."""
    return tuple((name, e.steps, e.flops_per_step, e.batch_group) for name, e in req.estimates.nodes.items())


def _in_prologue(req: EngineRequest) -> bool:
    """Before the request's first loop step: a one-shot node, a loop still to ``init``, or a
    loop whose stage says its next step is still prologue (an AR loop's prefill chunks)."""
    if req.loop is not None:
        return req.node is not None and bool(req.node.stage.in_prologue(req.loop))
    return any(node.is_loop for node in req.nodes[req.node_index:])
