"""``Engine``: the synchronous core — ``add_request``, ``step``, ``abort``.

Each ``step()`` asks the StepScheduler for one plan, executes it (a one-shot node, a
loop's init, or one batched loop step), and turns the results into events and finished
outputs. Failures are isolated per request; a pool-fatal error restarts the pool and
re-queues (or fails) the in-flight requests.

Streaming edges (pipeline/streams.py) are the engine's: it puts a loop's chunks on the
request's edge channels, closes them when the loop ends, starts a declared edge's consumer
as a lane at its first chunk (``_start_consumers``), and ends every lane with its request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Literal

import torch

from omniloop.deploy import DeployConfig, Limits
from omniloop.cache.chunk_kv import cache_pool_budgets
from omniloop.engine.admission import Admitted, admit
from omniloop.engine.checkpoints import LoopCheckpoints
from omniloop.engine.memory_budget import MemoryBudget, default_memory_budget
from omniloop.engine.cost_model import CostModel, ItemCost
from omniloop.engine.errors import EngineDeadError, PoolFatalError, QueueFull, RequestRejected, UnknownRequest
from omniloop.engine.fanout import FanOutPool
from omniloop.engine.request import EngineRequest
from omniloop.engine.scheduler import NodeWork, SchedulerPlan, SchedulingPolicy, StepScheduler, StepWork
from omniloop.engine.step_timer import StepTimer, step_timer_for
from omniloop.engine.weights import DEFAULT_ROLE, Running, SleepReport, WeightInfo, WeightPlane, WeightSource, WhileAsleep
from omniloop.ext.hooks import ArtifactEmitted, HookChain, NodeEvent, RequestEvent, ScheduleEvent, StepEvent, loop_timestep
from omniloop.ext.install import plugin_chain
from omniloop.ext.scope import request_scope, using_scope
from omniloop.pipeline.checkpoint import CheckpointMismatch, CheckpointUnsupported
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node
from omniloop.pipeline.state import LoopState, RequestState, StepResult
from omniloop.request import (
    ArtifactEvent,
    ErrorKind,
    Failure,
    FinalEvent,
    InvalidRequest,
    OmniEvent,
    OmniOutput,
    OmniRequest,
    ProgressEvent,
    RequestStatus,
    StatusEvent,
    failure_of,
)

logger = logging.getLogger(__name__)
EventSink = Callable[[OmniEvent], None]


@dataclass(frozen=True)
class EngineConfig:
    max_queue: int = 64  # waiting requests; beyond it add_request raises QueueFull
    memory_budget_bytes: int | None = None  # None: measured free memory at start
    nan_check: bool = True  # a non-finite loop state fails that request
    on_pool_failure: Literal["requeue", "fail"] = "requeue"
    max_pool_restarts: int = 3
    max_request_attempts: int = 2  # pool restarts a request may be re-queued through
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)
    limits: Limits | None = None  # the deployment's request ceilings; None: none (tests, training rollouts)
    while_asleep: WhileAsleep = "wait"  # requests arriving while asleep (sleep()) wait, or are refused (asleep)

    @classmethod
    def from_deploy(cls, deploy: DeployConfig) -> "EngineConfig":
        budget = None if deploy.memory_budget_gb is None else int(deploy.memory_budget_gb * 2**30)
        policy = SchedulingPolicy(kind=deploy.scheduling, max_running=deploy.max_running, max_batch=deploy.max_batch,
                                  max_batch_tokens=deploy.max_batch_tokens)
        return cls(max_queue=deploy.max_queue, memory_budget_bytes=budget, nan_check=deploy.nan_check,
                   on_pool_failure=deploy.on_pool_failure, policy=policy, limits=deploy.limits)


@dataclass
class EngineStats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    pool_restarts: int = 0
    steps: int = 0
    batched_steps: int = 0  # steps that ran more than one request
    node_steps: dict[str, int] = field(default_factory=dict)  # the two counts above, per loop node
    node_batched_steps: dict[str, int] = field(default_factory=dict)

    def count_step(self, node: str, requests: int) -> None:
        self.steps += 1
        self.batched_steps += requests > 1
        self.node_steps[node] = self.node_steps.get(node, 0) + 1
        self.node_batched_steps[node] = self.node_batched_steps.get(node, 0) + (requests > 1)


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        config: EngineConfig | None = None,
        *,
        event_sink: EventSink | None = None,
        restart_pool: Callable[[], Pipeline] | None = None,
        step_timer: StepTimer | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.config = config or EngineConfig()
        self.event_sink = event_sink
        self._restart_pool = restart_pool
        pools = cache_pool_budgets(pipeline)  # budgets carved out of device memory at start
        budget = self.config.memory_budget_bytes or max(default_memory_budget(pipeline.device) - sum(pools.values()), 0)
        self.cost_model = CostModel.for_device(pipeline.device)
        memory = MemoryBudget(budget, max_batch=self.config.policy.max_batch, pool_budgets=pools)
        self.scheduler = StepScheduler(self.cost_model, memory, self.config.policy)
        # Step times without a per-step device sync (CUDA events read a step later).
        self._own_timer = step_timer is None
        self.step_timer = step_timer or step_timer_for(pipeline.device)
        self.stats = EngineStats()
        self.dead: str | None = None
        self.accepting = True
        self._finished: dict[str, OmniOutput] = {}
        # add_request/abort may come from other threads while step() runs: new requests
        # wait in an intake deque and enter the scheduler at the next step boundary.
        self._intake: deque[EngineRequest] = deque()
        self._requests: dict[str, EngineRequest] = {}  # every request not yet popped
        self._forget: set[str] = set()  # aborted requests whose output nobody will pop
        self._ids_lock = threading.Lock()
        # Observer chain of the deployment's plugins (None: no plugins, no hook calls).
        self.hooks: HookChain | None = plugin_chain(pipeline)
        self._fan_out: FanOutPool | None = None  # threads for fan-out nodes, made at first use
        # Where running loops' crash checkpoints go, and resumed requests' come from (a durable
        # job store: serve/job_checkpoints.py); None: no checkpoints (engine/checkpoints.py)
        self.checkpoints: LoopCheckpoints | None = None
        self.weights = WeightPlane(self, while_asleep=self.config.while_asleep)  # update_weights, sleep/wake

    # -- public API ---------------------------------------------------------------------
    def add_request(self, request: OmniRequest, *, paused: bool = False) -> str:
        """Validate and queue ``request``. Raises RequestRejected (ValueError) naming the
        problem; nothing is queued then. ``paused``: admitted, but none of its steps run
        until ``resume`` (a live session waiting for its viewer)."""
        if self.dead:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        if not self.accepting:
            self.stats.rejected += 1
            raise QueueFull("engine is draining and accepts no new requests", kind=ErrorKind.DRAINING)
        try:
            self.weights.check_accepting()
        except QueueFull:
            self.stats.rejected += 1
            raise
        try:
            admitted = admit(self.pipeline, request, limits=self.config.limits, memory=self.scheduler.memory)
        except InvalidRequest as e:  # a typed refusal (fields, kind) of a validator or the limits
            self.stats.rejected += 1
            raise RequestRejected.of(e) from None
        except ValueError as e:  # an input that could not be read (an image, a video): no field to name
            self.stats.rejected += 1
            raise RequestRejected(str(e)) from None
        req = self._track(admitted, paused=paused)
        rid = request.request_id
        with self._ids_lock:
            if rid in self._requests:
                self.stats.rejected += 1
                raise RequestRejected(f"request_id {rid!r} is already in use", hint="pass a new id (or omit it)",
                                      fields=("request_id",), kind=ErrorKind.DUPLICATE)
            if len(self.scheduler.waiting) + len(self._intake) >= self.config.max_queue:
                self.stats.rejected += 1
                raise QueueFull(f"queue is full ({self.config.max_queue} waiting)", hint="retry later")
            self._requests[rid] = req
            self._intake.append(req)
        self._emit(StatusEvent(request_id=rid, status=RequestStatus.QUEUED, predicted_cost_s=req.predicted_total_s,
                               resolved=admitted.request, steps=admitted.steps))
        return rid

    def abort(self, request_id: str, *, forget: bool = False, reason: str | None = None) -> None:
        """Cancel at the next step boundary (at once if still waiting). ``forget``: nobody
        will pop the output (its caller went away): the request leaves every table when it
        ends, and at once if it has ended already. ``reason``: the output's error (default
        "cancelled by request"), e.g. a drain timeout's."""
        with self._ids_lock:
            req = self._requests.get(request_id)
            if req is None:
                raise UnknownRequest(f"no request {request_id!r}; pass the id add_request returned")
            if forget and self._finished.pop(request_id, None) is not None:
                del self._requests[request_id]
                return
            if forget:
                self._forget.add(request_id)
            req.abort_requested = True  # no-op for a finished request
            req.abort_reason = req.abort_reason or reason

    def pause(self, request_id: str) -> None:
        """Hold a queued or running request: none of its steps run (its state stays) until
        ``resume``. An abort still ends it. Takes effect at the next step boundary."""
        self._tracked(request_id).paused = True

    def resume(self, request_id: str) -> None:
        """Let a paused request's steps run again, from where it stopped."""
        self._tracked(request_id).paused = False

    def _tracked(self, request_id: str) -> EngineRequest:
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            raise UnknownRequest(f"no live request {request_id!r}; pass the id add_request returned")
        return req

    def is_tracked(self, request_id: str) -> bool:
        """Whether ``request_id`` is in use: queued, running, or finished and not yet popped."""
        return request_id in self._requests

    def tracked_ids(self) -> list[str]:
        with self._ids_lock:
            return list(self._requests)

    def send(self, request_id: str, item: Any) -> None:
        """Hand a live input to a running request's loop (a session's action, prompt or
        flush: see ``ChunkRollout``); it takes effect at the loop's next chunk or step."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            raise UnknownRequest(f"no running request {request_id!r}; pass the id of a live session")
        req.state.inbox.append(item)  # deque.append: safe from another thread

    def idle_s(self) -> float | None:
        """Seconds until some work can run (0: now; None: nothing queued or running)."""
        if self.weights.pending:
            return 0.0
        asleep = self.weights.idle_s()
        if asleep is not None:
            return asleep
        if self._intake or self.scheduler.waiting:
            return 0.0
        return self.scheduler.next_ready_s()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._intake) or self.weights.pending

    # -- the weight plane (engine/weights.py) ----------------------------------------------
    def update_weights(self, source: WeightSource, version: str | int, *, role: str = DEFAULT_ROLE,
                       component: str = "transformer", running: Running = "finish") -> WeightInfo:
        """Swap ``component``'s weights for ``source`` (a safetensors file, a state dict, a
        module) as ``version`` at a step boundary, driving the engine until it is done: for the
        thread that steps this engine (an AsyncEngine's callers use ``AsyncEngine.update_weights``).
        A bad source or an older version raises WeightUpdateRefused and nothing changes."""
        return self._drive(self.weights.schedule_update(source, version, role=role, component=component,
                                                        running=running))

    def sleep(self, level: int = 1, *, running: Running = "finish") -> SleepReport:
        """Release weights and caches (level 1: the loops' DiT/LM and KV; 2: everything)."""
        return self._drive(self.weights.schedule_sleep(level, running=running))

    def wake(self) -> SleepReport:
        """Restore what ``sleep`` released; waiting requests run again."""
        return self._drive(self.weights.schedule_wake())

    def _drive(self, future: Any) -> Any:
        while not future.done():
            self.step()
        return future.result()

    def step(self) -> list[OmniOutput]:
        """One scheduler iteration; returns the outputs of requests that finished in it."""
        if self.dead:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        with self._ids_lock:  # pop_output may run on another thread
            done_before = set(self._finished)
        while self._intake:
            self.scheduler.add(self._intake.popleft())
        if self.weights.pending:  # a weight update or sleep/wake waits for this boundary
            self.weights.at_boundary()
        self.step_timer.collect()  # the device times of steps the GPU has finished -> cost model
        plan = self.scheduler.schedule()
        if self.hooks is not None:
            self._fire("schedule_decision", lambda: ScheduleEvent(plan))
        self._apply_plan_boundaries(plan)
        try:
            self._run_plan(plan)
        except PoolFatalError as e:
            self._on_pool_failure(e)
        with self._ids_lock:
            return [out for rid, out in self._finished.items() if rid not in done_before]

    def run_until_done(self, request_id: str) -> OmniOutput:
        """Drive the engine until ``request_id`` finishes (the offline path)."""
        while request_id not in self._finished:
            if request_id not in self._requests:
                raise UnknownRequest(f"no request {request_id!r}; pass the id add_request returned")
            self.step()
        return self._finished[request_id]

    def pop_output(self, request_id: str) -> OmniOutput | None:
        """Hand over a finished output and forget the request (its id becomes reusable)."""
        with self._ids_lock:
            out = self._finished.pop(request_id, None)
            if out is not None:
                self._requests.pop(request_id, None)
        return out

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._intake)

    def num_running(self) -> int:
        return self.scheduler.num_running

    def predicted_backlog_s(self) -> float:
        """Predicted seconds of work left over every running and queued request (the cost
        model's): how long the queue takes to drain, for a refused client's Retry-After.
        Read from another thread: a snapshot, 0 for requests not yet admitted."""
        try:
            running = sum(self.scheduler.remaining_s(r) for r in list(self.scheduler.running.values()))
            waiting = sum(r.predicted_total_s for r in list(self.scheduler.waiting))
        except (RuntimeError, KeyError):  # the engine thread changed a request meanwhile: no estimate
            return 0.0
        return running + waiting

    def plugin_metrics(self) -> dict[str, Any]:
        """Metrics of the deployment's plugins (profiler timings, cache hit rates, ...)."""
        return self.hooks.metrics() if self.hooks is not None else {}

    # -- plan execution -------------------------------------------------------------------
    def _run_plan(self, plan: SchedulerPlan) -> None:
        """Execute the plan's work. On an SPMD pool's rank 0 (engine/pool.py) this also sends
        the plan to the other ranks, which execute the same work on their shards."""
        if plan.work is not None:
            self._execute(plan.work)

    def _apply_plan_boundaries(self, plan: SchedulerPlan) -> None:
        for rid in plan.aborted:
            req = self.scheduler.find(rid)
            if req is not None and req.failure is not None:  # its event consumer failed
                self._finish(req, RequestStatus.FAILED, req.failure)
            elif req is not None:
                self._finish(req, RequestStatus.CANCELLED,
                             Failure(kind=ErrorKind.CANCELLED, message=req.abort_reason or "cancelled by request"))
        for rid in plan.admitted:
            req = self.scheduler.running[rid]
            req.state.metrics.queue_s = req.state.mark_started() - req.arrival
            if self.hooks is not None:
                self._fire("request_start", lambda: RequestEvent(rid, request=req.request))
            self._emit(StatusEvent(request_id=rid, status=RequestStatus.RUNNING))

    def _execute(self, work: NodeWork | StepWork) -> None:
        if isinstance(work, NodeWork):
            self._run_node_work(work)
        else:
            self._run_steps([self.scheduler.running[rid] for rid in work.request_ids])

    def _run_node_work(self, work: NodeWork) -> None:
        reqs = self._at_node(work)
        if work.parallel and len(reqs) == 1 and self._fans_out(reqs[0], work):
            self._guarded(reqs[0], partial(self._run_fan_out, reqs[0], len(work.parallel) + 1))
            return
        if len(reqs) > 1 and self._batches_node(reqs[0]):
            try:
                self._run_nodes(reqs)
                return
            except PoolFatalError:
                raise
            except Exception:  # the stage wrote nothing: each request still there runs alone,
                reqs = self._at_node(work)  # so only the culprit fails
        for req in reqs:
            self._guarded(req, partial(self._run_node, req))

    def _guarded(self, req: EngineRequest, fn: Callable[[], None]) -> None:
        """``fn`` on behalf of ``req``: an exception fails ``req`` alone."""
        try:
            fn()
        except PoolFatalError:
            raise
        except Exception as exc:
            self._fail(req, exc)

    def _run_node(self, req: EngineRequest) -> None:
        node = req.node
        assert node is not None, f"request {req.request_id} has no node left to run"
        ctx = self.pipeline.contexts[node.name]
        item = self.scheduler.item_cost(req)
        if self.hooks is not None:
            self._fire("node_start", lambda: NodeEvent(req.request_id, node.name, node.is_loop))
        t0 = time.perf_counter()
        with using_scope(request_scope(node.name, req.request_id) if ctx.hooks is not None and ctx.hooks.taps else None):
            if node.is_loop:
                req.loop = node.stage.init(ctx, req.state)
                req.state.loops[node.name] = req.loop
                if self.checkpoints is not None:
                    self._resume_loop(req)
            else:
                node.stage.forward(ctx, req.state)
        self._account_node(req, item, time.perf_counter() - t0)
        if self.hooks is not None and (not node.is_loop or node.stage.progress_steps):  # else: node_end at its end
            kind = "loop_init" if node.is_loop else "node_end"
            self._fire(kind, lambda: NodeEvent(req.request_id, node.name, node.is_loop, req.loop))
        if not node.is_loop:
            self._next_node(req)
        elif req.loop is not None and req.loop.done:  # its work was all in init (a small VAE decode): no step to schedule
            self._end_loop(req)

    def _fans_out(self, req: EngineRequest, work: NodeWork) -> bool:
        """Siblings still the request's next nodes, in a deployment without plugins (their
        per-node events and tap scopes assume one node at a time)."""
        names = tuple(n.name for n in req.nodes[req.node_index + 1:req.node_index + 1 + len(work.parallel)])
        return names == work.parallel and self.hooks is None and all(
            self.pipeline.contexts[n].hooks is None for n in (work.node, *work.parallel))

    def _run_fan_out(self, req: EngineRequest, count: int) -> None:
        """The request's next ``count`` one-shot nodes at the same time (engine/fanout.py);
        each node's own time is its metric, and any failure fails the request."""
        nodes = req.nodes[req.node_index:req.node_index + count]
        if self._fan_out is None:
            self._fan_out = FanOutPool(self.pipeline.device)
        ran = self._fan_out.run([partial(self._forward_node, n, req.state) for n in nodes])
        for node, result in zip(nodes, ran):
            if result.error is not None:
                raise result.error
            self.cost_model.observe(ItemCost(node.name, "node", None), result.seconds)
            req.actual_s += result.seconds
            req.state.metrics.node_s[node.name] = req.state.metrics.node_s.get(node.name, 0.0) + result.seconds
        for _ in nodes[1:]:
            req.advance_node()
        self._next_node(req)

    def _forward_node(self, node: Node, state: RequestState) -> None:
        """One one-shot node's ``forward`` (a fan-out worker's call)."""
        node.stage.forward(self.pipeline.contexts[node.name], state)

    def _at_node(self, work: NodeWork) -> list[EngineRequest]:
        """The listed requests still running and still at the work's node."""
        return [r for r in map(self.scheduler.running.get, work.request_ids)
                if r is not None and r.node is not None and r.node.name == work.node]

    def _batches_node(self, req: EngineRequest) -> bool:
        """One ``forward_many`` for a group: a one-shot stage that offers it, in a deployment
        without plugins (their per-request node events and tap scopes need one call each)."""
        node = req.node
        assert node is not None, f"request {req.request_id} has no node left to run"
        ctx = self.pipeline.contexts[node.name]
        return not node.is_loop and node.stage.groups_forward and self.hooks is None and ctx.hooks is None

    def _run_nodes(self, reqs: list[EngineRequest]) -> None:
        """``_run_node`` for a group at one node, as one ``forward_many`` call."""
        node = reqs[0].node
        assert node is not None, f"request {reqs[0].request_id} has no node left to run"
        ctx = self.pipeline.contexts[node.name]
        items = [self.scheduler.item_cost(r) for r in reqs]
        t0 = time.perf_counter()
        node.stage.forward_many(ctx, [r.state for r in reqs])
        share = (time.perf_counter() - t0) / len(reqs)
        for req, item in zip(reqs, items):
            self._account_node(req, item, share)
            self._next_node(req)

    def _account_node(self, req: EngineRequest, item: ItemCost, seconds: float) -> None:
        """A one-shot node's (or loop init's) measured time: cost model and request metrics."""
        node = req.node
        assert node is not None, f"request {req.request_id} has no node to account"
        self.cost_model.observe(item, seconds)
        req.actual_s += seconds
        req.state.metrics.node_s[node.name] = req.state.metrics.node_s.get(node.name, 0.0) + seconds

    def _run_steps(self, reqs: list[EngineRequest]) -> None:
        """One step of every request in ``reqs`` (one ``step_many``); from its results on,
        each request's outcome is its own: a failed result, a non-finite state, a raising
        event consumer or ``finalize`` fails that request alone."""
        try:
            results = self._step_many(reqs)
        except PoolFatalError:
            raise
        except Exception as exc:
            if len(reqs) == 1:
                self._fail(reqs[0], exc)
                return
            # step_many raised before changing any loop (the LoopStage contract): retry each
            # alone so only the culprit fails
            for req in reqs:
                self._run_steps([req])
            return
        finite = self._finite(reqs, results)
        for req, result, ok in zip(reqs, results, finite):
            self._guarded(req, partial(self._after_step, req, result, ok))

    def _step_many(self, reqs: list[EngineRequest]) -> list[StepResult]:
        node = reqs[0].node
        assert node is not None, f"request {reqs[0].request_id} stepped outside a loop"
        ctx = self.pipeline.contexts[node.name]
        loops = [_live_loop(r) for r in reqs]
        items = [self.scheduler.item_cost(r) for r in reqs]
        predicted = [self.cost_model.predict(i) for i in items]
        hooks = self.hooks
        events: list[StepEvent] | None = None
        if hooks is not None and (hooks.step_start is not None or hooks.step_end is not None):
            events = [StepEvent(lp.request_id, node.name, lp.steps_done, lp.steps_target, lp, len(loops), loop_timestep(lp))
                      for lp in loops]
            if hooks.step_start is not None:
                for event in events:
                    hooks.step_start(event)
        mark = self.step_timer.start()
        results = node.stage.step_many(ctx, loops) if len(reqs) > 1 else [node.stage.step(ctx, loops[0])]
        self.step_timer.stop(mark, partial(self._account_step, reqs, loops, items, predicted))
        if hooks is not None and events is not None and hooks.step_end is not None:
            for event in events:
                hooks.step_end(event)
        self.stats.count_step(node.name, len(reqs))
        return results

    def _account_step(self, reqs: list[EngineRequest], loops: list[LoopState], items: list[ItemCost], predicted: list[float],
                      seconds: float) -> None:
        """A step's measured time (possibly a step later, see StepTimer), apportioned to its
        requests by predicted cost: cost model, request metrics."""
        total = sum(predicted) or 1.0
        for req, loop, item, pred in zip(reqs, loops, items, predicted):
            share = seconds * pred / total
            self.cost_model.observe(item, share)
            req.actual_s += share
            loop.step_times.append(share)
            node_s = req.state.metrics.node_s
            node_s[loop.node] = node_s.get(loop.node, 0.0) + share

    def _finite(self, reqs: list[EngineRequest], results: list[StepResult]) -> list[bool]:
        """The NaN/Inf check of the loops that stepped (one ``finite_many`` for the batch;
        a check that raises is retried per loop, its error that loop's)."""
        if not self.config.nan_check:
            return [True] * len(reqs)
        node = reqs[0].node
        assert node is not None, f"request {reqs[0].request_id} stepped outside a loop"
        stage = node.stage
        ok = [i for i, r in enumerate(results) if r.error is None]
        finite = [True] * len(reqs)
        try:
            for i, flag in zip(ok, stage.finite_many([reqs[i].loop for i in ok]) if ok else ()):
                finite[i] = flag
            return finite
        except PoolFatalError:
            raise
        except Exception:
            pass
        for i in ok:
            try:
                finite[i] = stage.finite_many([reqs[i].loop])[0]
            except PoolFatalError:
                raise
            except Exception as exc:
                results[i] = StepResult.failed(exc)
        return finite

    def _after_step(self, req: EngineRequest, result: StepResult, finite: bool) -> None:
        node, loop = req.node, req.loop
        assert node is not None and loop is not None, f"request {req.request_id} stepped outside a loop"
        if result.error is not None:
            self._fail(req, result.error)
            return
        if not finite:
            where = f"in node {node.name!r} at step {loop.steps_done}"
            self._finish(req, RequestStatus.FAILED,
                         Failure(kind=ErrorKind.NON_FINITE, message=f"non-finite values (NaN/Inf) {where}"))
            return
        # NOTE: events are built only when someone receives them: a ProgressEvent (and its ETA:
        # a walk over the request's nodes) per request per step is a measurable share of a
        # batched decode step's host time (tiny Cosmos3, batch 32: ~25 us a row)
        if self.event_sink is not None and node.stage.progress_steps:
            eta = self.scheduler.remaining_s(req)
            self._emit(ProgressEvent(request_id=req.request_id, node=node.name, step=loop.steps_done,
                                     total=loop.steps_target, eta_s=eta))
        if self.event_sink is not None or self.hooks is not None:
            for name, artifact in result.emit or ():
                self._emit(ArtifactEvent(request_id=req.request_id, name=name, artifact=artifact, partial=True))
        if result.chunks:
            self._put_chunks(req, result.chunks)
        root = req.root
        if root.failure is not None:  # its event consumer failed on one of these
            self._finish(req, RequestStatus.FAILED, root.failure)
        elif result.done:
            self._end_loop(req)
        else:
            if result.chunks:
                self._start_consumers(root)
            if self.checkpoints is not None and req.parent is None:  # a lane's loop is not checkpointed
                self._checkpoint(req)

    # -- streaming edges (pipeline/streams.py) ---------------------------------------------
    def _put_chunks(self, req: EngineRequest, chunks: list[tuple[str, Any]]) -> None:
        """A step's chunks onto the request's channels (dropped where no active node reads them)."""
        node = req.node
        assert node is not None, f"{req.key} emitted chunks outside a node"
        ctx = self.pipeline.contexts[node.name]
        channels = req.state.channels
        for port, chunk in chunks:
            channel = channels.get(ctx.outputs.get(port, port))
            if channel is not None:
                chunk.node = node.name
                channel.put(chunk)

    def _start_consumers(self, root: EngineRequest) -> None:
        """Start, as lanes, the consumers of the request's declared stream edges that have a
        chunk, whose other inputs are all there, and that neither ran nor run yet."""
        channels = root.state.channels
        for declared in self.pipeline.spec.streams:
            channel = channels.get(declared.edge)
            if channel is None or not channel.produced:
                continue
            for node in root.nodes[root.node_index + 1:]:
                if declared.edge in node.stream_input_edges() and self._can_start(root, node):
                    self.scheduler.add_lane(root.start_lane(node))

    def _can_start(self, root: EngineRequest, node: Any) -> bool:
        if node.name in root.lanes or node.name in root.done_nodes:
            return False
        reads = [*node.input_edges(), *node.input_edges(optional=True)]
        producers = [n.name for n in root.nodes if any(e in reads for e in n.output_edges())]
        channels = root.state.channels
        return (all(p in root.done_nodes for p in producers)
                and all(channels[e].readable for e in node.stream_input_edges() if e in channels))

    def _close_streams(self, req: EngineRequest) -> None:
        """The loop that feeds them ended: its channels get no more chunks."""
        channels, node = req.state.channels, req.node
        for edge in node.stream_output_edges() if channels and node is not None else ():
            if edge in channels:
                channels[edge].close()
    # -- crash checkpoints (engine/checkpoints.py) ------------------------------------------
    def _resume_loop(self, req: EngineRequest) -> None:
        """A just-``init``-ed loop continues from the request's checkpoint, if it has one for
        this node (a job resumed after a crash); one that does not fit is set aside and the
        loop runs from its first step."""
        node, loop, store = req.node, req.loop, self.checkpoints
        assert node is not None and loop is not None and store is not None, "resume outside a loop's init"
        checkpoint = store.resume_point(req.request_id, node.name)
        if checkpoint is not None:
            try:
                node.stage.restore(self.pipeline.contexts[node.name], loop, checkpoint)
            except CheckpointMismatch as e:
                store.resumed(req.request_id, node.name, None, f"its checkpoint does not fit: {e}")
            else:
                store.resumed(req.request_id, node.name, loop.steps_done, None)
                if self.event_sink is not None and node.stage.progress_steps:
                    self._emit(ProgressEvent(request_id=req.request_id, node=node.name, step=loop.steps_done,
                                             total=loop.steps_target, eta_s=self.scheduler.remaining_s(req)))
        wanted = store.wants(req.request_id) and node.stage.progress_steps  # not a streamed decode's split
        req.checkpoint_mark = (loop.steps_done, time.perf_counter()) if wanted else None

    def _checkpoint(self, req: EngineRequest) -> None:
        """The request's loop checkpointed if the cadence says it is due (never fails the request:
        a loop that cannot be checkpointed runs on without, a write that fails is logged)."""
        store, loop, node, mark = self.checkpoints, req.loop, req.node, req.checkpoint_mark
        assert store is not None and loop is not None and node is not None, "checkpoint outside a loop"
        if mark is None or not store.cadence.due(loop.steps_done - mark[0], time.perf_counter() - mark[1]):
            return
        try:
            store.save(req.request_id, node.stage.checkpoint(loop))
        except CheckpointUnsupported as e:
            logger.debug("request %s: node %s is not checkpointed (%s)", req.request_id, node.name, e)
            req.checkpoint_mark = None
            return
        except PoolFatalError:
            raise
        except Exception:
            logger.exception("request %s: checkpoint of node %s at step %d failed", req.request_id, node.name,
                             loop.steps_done)
        req.checkpoint_mark = (loop.steps_done, time.perf_counter())

    def _end_loop(self, req: EngineRequest) -> None:
        node, loop = req.node, req.loop
        assert node is not None and loop is not None, f"request {req.request_id} ends a loop outside one"
        ctx = self.pipeline.contexts[node.name]
        node.stage.finalize(ctx, loop, req.state)
        self._close_streams(req)
        self.scheduler.memory.release_loop(req.request_id, node.name)  # e.g. its KV cache
        if self.hooks is not None:
            if node.stage.progress_steps:  # a streamed decode looks like the one-shot node to plugins
                self._fire("loop_finalize", lambda: NodeEvent(req.request_id, node.name, True, loop))
            self._fire("node_end", lambda: NodeEvent(req.request_id, node.name, True, loop))
        if node.stage.progress_steps:  # not a streamed decode's steps: the request's own steps
            req.state.metrics.steps += loop.steps_done
        req.state.loops.pop(node.name, None)
        self._next_node(req)

    def _next_node(self, req: EngineRequest) -> None:
        adopted = req.advance_node()
        if adopted is not None:  # the cursor took a lane's loop over
            self.scheduler.remove(adopted.key)
        if req.parent is not None:  # a lane's one node is done: the lane ends, its request goes on
            req.parent.lanes.pop(req.nodes[0].name, None)
            self.scheduler.remove(req.key)
            self._start_consumers(req.parent)
        elif req.node is None:
            self._finish(req, RequestStatus.COMPLETED, None)
        elif req.state.channels:
            self._start_consumers(req)

    # -- endings --------------------------------------------------------------------------
    def _fail(self, req: EngineRequest, exc: BaseException) -> None:
        logger.error("request %s failed", req.request_id, exc_info=exc)
        self._finish(req, RequestStatus.FAILED, failure_of(exc))

    def _finish(self, req: EngineRequest, status: RequestStatus, failure: Failure | None) -> None:
        req = req.root  # a lane's failure is its request's
        if req.is_finished:
            return
        self.scheduler.remove(req.request_id)
        self._end_lanes(req)
        state = req.state
        finished = state.mark_finished(status, failure)
        self.step_timer.collect(wait=True)  # its metrics must hold every step's time
        metrics = state.metrics
        if state.started_at is not None:
            metrics.run_s = finished - state.started_at
        else:
            metrics.queue_s = finished - req.arrival
        metrics.predicted_cost_s = req.predicted_total_s
        metrics.actual_cost_s = req.actual_s
        metrics.peak_memory_bytes = _peak_memory(self.pipeline.device, req)
        output = self.pipeline.collect_output(state, status)
        output.weight_version = self.weights.version
        if req.loop is not None and req.node is not None:
            req.node.stage.release(req.loop)  # cancelled or failed mid-loop: free its cache now
        state.loops.clear()
        req.loop = None
        state.artifacts.clear()  # free the request's tensors; the output holds what it returns
        state.release_refs()  # shared cache entries (text embeddings, adapters) it pinned
        if self.checkpoints is not None:
            self.checkpoints.discard(req.request_id)
        with self._ids_lock:
            if req.request_id in self._forget:  # nobody will pop it: forget the request now
                self._forget.discard(req.request_id)
                self._requests.pop(req.request_id, None)
            else:
                self._finished[req.request_id] = output
        self.stats.completed += status is RequestStatus.COMPLETED
        self.stats.failed += status is RequestStatus.FAILED
        self.stats.cancelled += status is RequestStatus.CANCELLED
        for name, art in output.artifacts.items():
            self._emit(ArtifactEvent(request_id=req.request_id, name=name, artifact=art, partial=False))
        if self.hooks is not None:
            self._fire("request_end", lambda: RequestEvent(req.request_id, request=req.request, output=output))
        self._emit(FinalEvent(request_id=req.request_id, output=output))

    def _end_lanes(self, req: EngineRequest) -> None:
        """Stop every lane of a request that ends (cancel, failure): free their loops now."""
        for lane in req.lanes.values():
            self.scheduler.remove(lane.key)
            if lane.loop is not None:
                lane.nodes[0].stage.release(lane.loop)
                lane.loop = None
        req.lanes.clear()
        req.state.channels.clear()

    def _on_pool_failure(self, error: PoolFatalError) -> None:
        self.stats.pool_restarts += 1
        logger.error("pool-fatal error (%s); restart %d", error, self.stats.pool_restarts)
        if self.stats.pool_restarts > self.config.max_pool_restarts:
            self.dead = f"pool failed {self.stats.pool_restarts} times; last: {error}"
            for req in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                self._finish(req, RequestStatus.FAILED,
                             Failure(kind=ErrorKind.ENGINE_DEAD, message=f"engine dead: {error}"))
            return
        if self._restart_pool is not None:
            self.pipeline = self._restart_pool()
            self.hooks = plugin_chain(self.pipeline)
            self.weights.on_pipeline_rebuilt()  # the checkpoint's weights again
        if self._own_timer:  # events recorded on a corrupt context cannot be read
            self.step_timer = step_timer_for(self.pipeline.device)
        in_flight = list(self.scheduler.running.values())
        if self.config.on_pool_failure == "fail":
            for req in in_flight:
                self._finish(req, RequestStatus.FAILED, Failure(kind=ErrorKind.POOL_FAILED,
                                                                message=f"worker pool failed: {error}"))
            return
        for req in self.scheduler.requeue_running():
            req.attempts += 1
            if req.attempts > self.config.max_request_attempts:
                self._finish(req, RequestStatus.FAILED, Failure(
                    kind=ErrorKind.POOL_FAILED, message=f"worker pool failed {req.attempts} times: {error}"))
            else:
                # Rebind to the (possibly rebuilt) pipeline and start over from scratch.
                req.state.release_refs()
                req.state = self.pipeline.admit(req.request)
                req.nodes = self.pipeline.active_nodes(req.request)

    # -- admitted requests -----------------------------------------------------------------
    def _track(self, admitted: Admitted, *, paused: bool = False) -> EngineRequest:
        """The runtime record of an admitted request, with its predicted seconds of work."""
        req = EngineRequest(request=admitted.request, state=admitted.state, nodes=admitted.nodes,
                            estimates=admitted.estimates, paused=paused)
        req.predicted_total_s = self.scheduler.remaining_s(req)
        return req

    def _emit(self, event: OmniEvent) -> None:
        if self.hooks is not None and isinstance(event, ArtifactEvent):
            self._fire("artifact_emitted", lambda: ArtifactEmitted(event.request_id, event.name, event.artifact, event.partial))
        if self.event_sink is None:
            return
        try:
            self.event_sink(event)
        except Exception as exc:  # this request's consumer failed: the request fails, nothing else
            logger.error("event sink failed on %s event of request %s", event.type, event.request_id, exc_info=exc)
            req = self._requests.get(event.request_id)
            if req is not None and not req.is_finished and req.failure is None:
                why = f"event sink failed on its {event.type} event: {type(exc).__name__}: {exc}"
                req.failure = Failure(kind=ErrorKind.CONSUMER_FAILED, message=why)
                req.abort_requested = True  # leaves at the next step boundary if not at once

    def _fire(self, point: str, make: Callable[[], Any]) -> None:
        """Call hook ``point`` with the event ``make()`` builds, if anyone subscribed."""
        fan = getattr(self.hooks, point)
        if fan is not None:
            fan(make())


def _live_loop(req: EngineRequest) -> LoopState:
    """The loop a request the scheduler steps is in (set by its node's ``init``)."""
    assert req.loop is not None, f"request {req.request_id} stepped before its loop's init"
    return req.loop


def _peak_memory(device: torch.device, req: EngineRequest) -> int:
    """Device: the allocator's peak while the engine ran (engine-wide, since requests share
    it); CPU: the request's admission estimate alone (state + one step's activations)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(req.memory.alone_bytes)
