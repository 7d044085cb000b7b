"""A role pool's worker process (engine/role_pool.py): it builds the pipeline on its own
device and runs the node operations rank 0 sends — a one-shot node's ``forward``, a loop's
``init`` / batched ``step`` / ``finalize`` — on request states it keeps for the requests
that reached it. It never schedules: every call is a decision of rank 0's StepScheduler.

A request's failure inside a call is that request's (``ItemResult.error``), as in the
engine: a batched step that raises is retried loop by loop so only the culprit fails.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.connectors import Connector, TransferMetric, connector_for
from omniloop.engine.role_messages import CallItem, CallReply, ItemResult, LoopView, NodeCall, PoolFailed, PoolReady
from omniloop.engine.worker_loop import WorkerPipe, die, serve_messages
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node
from omniloop.pipeline.state import LoopState, RequestState, StepResult

logger = logging.getLogger(__name__)


def loop_view(node: Node, loop: LoopState, state: RequestState, finite: bool = True) -> LoopView:
    """The scheduler's reading of ``loop`` (what rank 0 would ask the stage), with how many
    chunks of each stream it reads the loop has taken (rank 0's channel drops as many)."""
    stage = node.stage
    consumed = tuple((e, state.channels[e].consumed) for e in node.stream_input_edges() if e in state.channels)
    return LoopView(steps_done=loop.steps_done, steps_target=loop.steps_target, batch_key=stage.batch_key(loop),
                    batch_weight=stage.batch_weight(loop), step_flops=stage.step_flops(loop), ready=stage.ready(loop),
                    ready_at=stage.ready_at(loop), in_prologue=stage.in_prologue(loop), finite=finite,
                    consumed=consumed)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class RoleWorker:
    """The request states and loops one pool holds, and the calls that act on them."""

    def __init__(self, name: str, pipeline: Pipeline, connector: Connector) -> None:
        self.name = name
        self.pipeline = pipeline
        self.connector = connector
        self.states: dict[str, RequestState] = {}
        self.loops: dict[tuple[str, str], LoopState] = {}  # (request id, node) -> live loop
        self._received: list[TransferMetric] = []

    def run(self, call: NodeCall) -> CallReply:
        self._received = []
        if call.op == "step":
            results = self._step(call)
        elif call.op == "forward_many":
            results = self._forward_many(call)
        else:
            results = [self._one(call, item) for item in call.items]
        return CallReply(tuple(results), tuple(self._received))

    # -- one request at a time ---------------------------------------------------------------
    def _one(self, call: NodeCall, item: CallItem) -> ItemResult:
        try:
            return self._ops[call.op](self, call.node, item)
        except Exception as exc:  # this request's failure; the pool goes on
            logger.error("pool %s: %s of node %s failed for %s", self.name, call.op, call.node, item.request_id,
                         exc_info=exc)
            self._drop_loop(item.request_id, call.node)
            return ItemResult(error=_error(exc))

    def _state(self, item: CallItem) -> RequestState:
        state = self.states.get(item.request_id)
        if state is None:
            assert item.request is not None, f"pool {self.name}: first call for {item.request_id!r} without its request"
            state = self.states[item.request_id] = self.pipeline.admit(item.request)
        for packed in (item.inputs, *item.forwarded):
            if packed is None:
                continue
            artifacts, metric = self.connector.unpack(packed, self.name, self.pipeline.device)
            self._received.append(metric)
            for edge, art in artifacts.items():
                state.put(edge, art, node=art.node)
        self._feed(state, item)
        return state

    def _feed(self, state: RequestState, item: CallItem) -> None:
        """A stream consumer's chunks that rank 0 forwarded, onto this pool's channels."""
        if item.chunks is not None:
            chunks, metric = self.connector.unpack(item.chunks, self.name, self.pipeline.device)
            self._received.append(metric)
            for edge, items in chunks.items():
                for chunk in items:
                    state.channels[edge].put(chunk)
        for edge in item.closed:
            state.channels[edge].close()

    def _outputs(self, node: str, state: RequestState) -> Any:
        edges = [e for e in self.pipeline.spec.node(node).output_edges() if e in state.artifacts]
        packed = self.connector.pack(state.request_id, self.name, {e: state.artifacts[e] for e in edges})
        state.artifacts.clear()  # the pool keeps no edge: each call brings the inputs it needs
        return packed

    def _forward(self, node: str, item: CallItem) -> ItemResult:
        state = self._state(item)
        self.pipeline.spec.node(node).stage.forward(self.pipeline.contexts[node], state)
        return ItemResult(outputs=self._outputs(node, state))

    def _forward_many(self, call: NodeCall) -> list[ItemResult]:
        """The grouped one-shot node (``forward_many``: one encoder call for every prompt). It
        raises before writing anything (the Stage contract): every item then carries the error
        and rank 0 retries each request alone."""
        states = [self._state(item) for item in call.items]
        try:
            self.pipeline.spec.node(call.node).stage.forward_many(self.pipeline.contexts[call.node], states)
        except Exception as exc:
            logger.error("pool %s: forward_many of %s failed", self.name, call.node, exc_info=exc)
            for state in states:
                state.artifacts.clear()
            return [ItemResult(error=_error(exc)) for _ in states]
        return [ItemResult(outputs=self._outputs(call.node, state)) for state in states]

    def _init(self, node: str, item: CallItem) -> ItemResult:
        state = self._state(item)
        spec_node = self.pipeline.spec.node(node)
        loop = spec_node.stage.init(self.pipeline.contexts[node], state)
        state.loops[node] = loop
        self.loops[(item.request_id, node)] = loop
        return ItemResult(view=loop_view(spec_node, loop, state))

    def _feed_op(self, node: str, item: CallItem) -> ItemResult:
        """A stream consumer's new chunks (or its producer's end) and no step: the loop's view
        again, so rank 0 learns whether they made it ready."""
        loop = self.loops.get((item.request_id, node))
        if loop is None:
            return ItemResult(error=f"RuntimeError: pool {self.name!r} holds no loop of node {node!r} for "
                                    f"{item.request_id!r} (the pool restarted and lost it)")
        state = self.states[item.request_id]
        self._feed(state, item)
        return ItemResult(view=loop_view(self.pipeline.spec.node(node), loop, state))

    def _finalize(self, node: str, item: CallItem) -> ItemResult:
        state = self.states[item.request_id]
        loop = self.loops.pop((item.request_id, node))
        self.pipeline.spec.node(node).stage.finalize(self.pipeline.contexts[node], loop, state)
        state.loops.pop(node, None)
        return ItemResult(outputs=self._outputs(node, state))

    def _release(self, node: str, item: CallItem) -> ItemResult:
        self._drop_loop(item.request_id, node)
        return ItemResult()

    def _forget(self, node: str, item: CallItem) -> ItemResult:
        """The request ended: everything the pool holds for it goes."""
        for key in [k for k in self.loops if k[0] == item.request_id]:
            self._drop_loop(*key)
        state = self.states.pop(item.request_id, None)
        if state is not None:
            state.release_refs()
        return ItemResult()

    def _drop_loop(self, request_id: str, node: str) -> None:
        loop = self.loops.pop((request_id, node), None)
        if loop is not None:
            self.pipeline.spec.node(node).stage.release(loop)
        state = self.states.get(request_id)
        if state is not None:
            state.loops.pop(node, None)

    _ops: dict[str, Callable[["RoleWorker", str, CallItem], ItemResult]] = {
        "forward": _forward, "init": _init, "feed": _feed_op, "finalize": _finalize, "release": _release, "forget": _forget,
    }

    # -- a batched step ----------------------------------------------------------------------
    def _step(self, call: NodeCall) -> list[ItemResult]:
        node = self.pipeline.spec.node(call.node)
        ctx = self.pipeline.contexts[call.node]
        loops = [self.loops.get((item.request_id, call.node)) for item in call.items]
        for item in call.items:
            if item.request_id in self.states:
                self._feed(self.states[item.request_id], item)
        if any(lp is None for lp in loops):  # not the pool's (a restart lost it): each alone says whose
            return [self._step_alone(call, item) for item in call.items]
        live: list[LoopState] = [lp for lp in loops if lp is not None]
        if len(live) == 1:
            return [self._step_alone(call, call.items[0])]
        try:
            results = node.stage.step_many(ctx, live)
        except Exception:  # raised before changing any loop (the LoopStage contract): each alone
            return [self._step_alone(call, item) for item in call.items]
        return self._step_results(call, live, results)

    def _step_alone(self, call: NodeCall, item: CallItem) -> ItemResult:
        loop = self.loops.get((item.request_id, call.node))
        if loop is None:
            return ItemResult(error=f"RuntimeError: pool {self.name!r} holds no loop of node {call.node!r} for "
                                    f"{item.request_id!r} (the pool restarted and lost it)")
        stage = self.pipeline.spec.node(call.node).stage
        try:
            result = stage.step(self.pipeline.contexts[call.node], loop)
        except Exception as exc:
            logger.error("pool %s: step of %s failed for %s", self.name, call.node, item.request_id, exc_info=exc)
            self._drop_loop(item.request_id, call.node)
            return ItemResult(error=_error(exc))
        return self._step_results(NodeCall("step", call.node, (item,)), [loop], [result])[0]

    def _step_results(self, call: NodeCall, loops: list[LoopState], results: list[StepResult]) -> list[ItemResult]:
        node = self.pipeline.spec.node(call.node)
        stage = node.stage
        ok = [i for i, r in enumerate(results) if r.error is None]
        finite = [True] * len(loops)
        for i, flag in zip(ok, stage.finite_many([loops[i] for i in ok]) if ok else ()):
            finite[i] = flag
        out = []
        for item, loop, result, fin in zip(call.items, loops, results, finite):
            if result.error is not None:
                self._drop_loop(item.request_id, call.node)
                out.append(ItemResult(error=_error(result.error)))
                continue
            emitted = None
            if result.emit or result.chunks:
                emitted = self.connector.pack(item.request_id, self.name,
                                              {"emit": list(result.emit or ()), "chunks": list(result.chunks or ())})
            view = loop_view(node, loop, self.states[item.request_id], fin)
            out.append(ItemResult(view=view, done=result.done, emitted=emitted))
        return out


def build_pool_pipeline(model: str, deploy: DeployConfig, device: torch.device) -> Pipeline:
    from omniloop.engine.async_engine import load_options
    from omniloop.models.loader import load_pipeline

    options = dataclasses.replace(load_options(deploy), device=device)
    return load_pipeline(model, options)[1]


PipelineBuilder = Callable[[str, DeployConfig, torch.device], Pipeline]


def role_worker_main(name: str, model: str, deploy_json: str, threads: int, conn: Any,
                     build: PipelineBuilder | None = None) -> None:
    """The process of pool ``name``: build (``build``: a module-level function; default: load
    ``model`` as the engine did), then answer calls until rank 0 says stop (None) or goes away."""
    pipe = WorkerPipe(conn, f"pool {name}", functools.partial(PoolFailed, name))
    try:
        torch.set_num_threads(threads)
        from omniloop.engine.pool_worker import _quiet_progress_bars

        _quiet_progress_bars()  # rank 0 shows the loading bars; a bar's lock would outlive os._exit
        deploy = DeployConfig.model_validate_json(deploy_json)
        spec = deploy.pools[name]
        pipeline = (build or build_pool_pipeline)(model, deploy, torch.device(spec.device))
        worker = RoleWorker(name, pipeline, connector_for(spec.connector))
        conn.send(PoolReady(name))
    except BaseException:
        die(pipe)
    serve_messages(pipe, worker.run)
    os._exit(0)
