"""The synchronous runner: drives one request through a built pipeline, node by node,
owning every loop's iteration (``init`` / ``step``... / ``finalize``).

This is the offline path (``VideoGenerator``) and the contract the engine's scheduler
reproduces step by step across many requests.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from omniloop.ext.hooks import NodeEvent, RequestEvent, StepEvent, loop_timestep
from omniloop.ext.install import check_plugin_params
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node
from omniloop.pipeline.state import RequestState
from omniloop.request import (
    ArtifactEvent,
    FinalEvent,
    OmniEvent,
    OmniOutput,
    OmniRequest,
    ProgressEvent,
    RequestStatus,
    StatusEvent,
)

logger = logging.getLogger(__name__)
EventSink = Callable[[OmniEvent], None]


def run_node(pipeline: Pipeline, node: Node, state: RequestState, on_event: EventSink | None = None) -> None:
    """Run one node of one request to completion."""
    ctx = pipeline.contexts[node.name]
    chain = ctx.hooks.chain if ctx.hooks is not None else None  # observers (None: no plugins)
    _fire(chain, "node_start", lambda: NodeEvent(state.request_id, node.name, node.is_loop))
    t0 = time.perf_counter()
    if not node.is_loop:
        node.stage.forward(ctx, state)
    else:
        loop = node.stage.init(ctx, state)
        state.loops[node.name] = loop
        _fire(chain, "loop_init", lambda: NodeEvent(state.request_id, node.name, True, loop))
        try:
            while True:
                event = StepEvent(state.request_id, node.name, loop.steps_done, loop.steps_target, loop,
                                  timestep=loop_timestep(loop)) if chain is not None else None
                _fire(chain, "step_start", lambda: event)
                t_step = time.perf_counter()
                result = node.stage.step(ctx, loop)
                loop.step_times.append(time.perf_counter() - t_step)
                _fire(chain, "step_end", lambda: event)
                if on_event is not None:
                    _emit_step_events(node, loop, result, state, on_event)
                if result.done:
                    break
        except BaseException:
            node.stage.release(loop)  # free the loop's caches; the caller reports the failure
            raise
        node.stage.finalize(ctx, loop, state)
        _fire(chain, "loop_finalize", lambda: NodeEvent(state.request_id, node.name, True, loop))
        state.metrics.steps += loop.steps_done
        del state.loops[node.name]
    state.metrics.node_s[node.name] = state.metrics.node_s.get(node.name, 0.0) + time.perf_counter() - t0
    _fire(chain, "node_end", lambda: NodeEvent(state.request_id, node.name, node.is_loop))


def _fire(chain, point: str, make: Callable) -> None:
    fan = getattr(chain, point) if chain is not None else None
    if fan is not None:
        fan(make())


def _emit_step_events(node: Node, loop, result, state: RequestState, on_event: EventSink) -> None:
    mean = sum(loop.step_times) / len(loop.step_times)
    eta = mean * max(loop.steps_target - loop.steps_done, 0)
    on_event(ProgressEvent(request_id=state.request_id, node=node.name, step=loop.steps_done,
                           total=loop.steps_target, eta_s=eta))
    for name, artifact in result.emit or ():
        on_event(ArtifactEvent(request_id=state.request_id, name=name, artifact=artifact, partial=True))


def run_request(pipeline: Pipeline, request: OmniRequest, on_event: EventSink | None = None) -> OmniOutput:
    """Admit and run ``request``; bad input raises ValueError before any work starts."""
    state = pipeline.admit(request)
    check_plugin_params(state.request, pipeline)
    return run_state(pipeline, state, on_event)


def run_state(pipeline: Pipeline, state: RequestState, on_event: EventSink | None = None) -> OmniOutput:
    state.mark_started()
    first = next(iter(pipeline.contexts.values()), None)
    chain = first.hooks.chain if first is not None and first.hooks is not None else None
    _fire(chain, "request_start", lambda: RequestEvent(state.request_id, request=state.request))
    if on_event is not None:
        on_event(StatusEvent(request_id=state.request_id, status=RequestStatus.RUNNING))
    t0 = time.perf_counter()
    try:
        for node in pipeline.active_nodes(state.request):
            run_node(pipeline, node, state, on_event)
        state.status = RequestStatus.COMPLETED
    except Exception as exc:  # one request's failure is reported, never raised past the runtime
        logger.exception("request %s failed", state.request_id)
        state.status = RequestStatus.FAILED
        state.error = f"{type(exc).__name__}: {exc}"
    state.metrics.run_s = time.perf_counter() - t0
    state.loops.clear()
    state.release_refs()
    output = pipeline.collect_output(state)
    _fire(chain, "request_end", lambda: RequestEvent(state.request_id, request=state.request, output=output))
    if on_event is not None:
        for name, art in output.artifacts.items():
            on_event(ArtifactEvent(request_id=state.request_id, name=name, artifact=art, partial=False))
        on_event(FinalEvent(request_id=state.request_id, output=output))
    return output
