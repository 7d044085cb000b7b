"""Observer hook points (tier 1 of the extension system): names, events, the chain.

Hook-point names are a versioned public surface (``HOOKS_VERSION``). An observer
subscribes to a hook point by overriding the method of that name on :class:`Observer`;
the :class:`HookChain` is assembled once at build and holds, per hook point, either
``None`` (no subscriber: the call site's ``is not None`` check is all that runs) or one
fan-out callable. Call sites build the event only when the point has subscribers.

Observers are read-only: events are frozen, return values are discarded, and an
observer that raises is logged and skipped — it can neither change nor fail a request.
Tensors and loop states in events are references; mutating them breaks the contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from omniloop.ext.plugin import Declarations
from omniloop.ext.scope import ForwardScope, Segment

logger = logging.getLogger(__name__)

HOOKS_VERSION = "1"

# plane -> hook points (the names observers override)
HOOK_PLANES: dict[str, tuple[str, ...]] = {
    "request": ("request_start", "request_end", "artifact_emitted", "schedule_decision"),
    "pipeline": ("node_start", "node_end", "loop_init", "loop_finalize", "step_start", "step_end"),
    "execution": ("model_forward_pre", "model_forward_post", "module_pre", "module_post", "cache_event"),
}
HOOK_POINTS: tuple[str, ...] = tuple(p for points in HOOK_PLANES.values() for p in points)
# Module taps are forward hooks on the matched modules, not chain entries.
MODULE_POINTS = ("module_pre", "module_post")


# -- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestEvent:
    request_id: str
    request: Any = None  # OmniRequest (request_start)
    output: Any = None  # OmniOutput (request_end)


@dataclass(frozen=True, slots=True)
class ArtifactEmitted:
    request_id: str
    name: str
    artifact: Any
    partial: bool


@dataclass(frozen=True, slots=True)
class ScheduleEvent:
    plan: Any  # engine SchedulerPlan


@dataclass(frozen=True, slots=True)
class NodeEvent:
    request_id: str
    node: str
    is_loop: bool
    loop: Any = None  # LoopState (loop_init / loop_finalize)


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One loop step: ``step`` is its index and ``timestep`` its timestep (None for loops
    without one), for step_start and step_end alike."""

    request_id: str
    node: str
    step: int
    steps_target: int
    loop: Any  # LoopState; read-only
    batch: int = 1  # loops in this step_many call
    timestep: Any = None


def loop_timestep(loop: Any) -> Any:
    """The timestep of the loop's next step (None when it has none or is done)."""
    if getattr(loop, "done", False):
        return None
    try:
        return getattr(loop, "timestep", None)
    except (IndexError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class ForwardEvent:
    node: str
    component: str
    scope: ForwardScope
    inputs: Any
    timestep: torch.Tensor
    output: Any = None  # model_forward_post


@dataclass(frozen=True, slots=True)
class TapEvent:
    """A module tap. ``value`` is the module output (post) or its positional inputs (pre)."""

    module: str
    scope: ForwardScope | None
    value: Any

    def per_segment(self) -> list[tuple[Segment | None, torch.Tensor]]:
        """The tapped tensor split into the rows of each (request, branch) segment."""
        tensor = _first_tensor(self.value)
        if tensor is None:
            return []
        if self.scope is None:
            return [(None, tensor)]
        return self.scope.split(tensor)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    plugin: str
    kind: str  # "alloc" | "hit" | "miss" | "evict"
    node: str
    request_id: str
    branch: str | None = None
    step: int | None = None
    nbytes: int = 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


# -- observers and the chain --------------------------------------------------------------


class Observer:
    """Base class of read-only observers: override the hook points you need.

    ``taps`` (a regex matched against ``component.module.path`` names, e.g.
    ``transformer\\.blocks\\.\\d+``) selects modules for ``module_pre``/``module_post``.
    """

    name: str = "observer"
    taps: str | None = None
    # the class's, or the instance's where its config decides (a profiler of blocks needs eager modules)
    declarations: Declarations = Declarations(kind="observer")

    def request_start(self, event: RequestEvent) -> None: ...
    def request_end(self, event: RequestEvent) -> None: ...
    def artifact_emitted(self, event: ArtifactEmitted) -> None: ...
    def schedule_decision(self, event: ScheduleEvent) -> None: ...
    def node_start(self, event: NodeEvent) -> None: ...
    def node_end(self, event: NodeEvent) -> None: ...
    def loop_init(self, event: NodeEvent) -> None: ...
    def loop_finalize(self, event: NodeEvent) -> None: ...
    def step_start(self, event: StepEvent) -> None: ...
    def step_end(self, event: StepEvent) -> None: ...
    def model_forward_pre(self, event: ForwardEvent) -> None: ...
    def model_forward_post(self, event: ForwardEvent) -> None: ...
    def module_pre(self, event: TapEvent) -> None: ...
    def module_post(self, event: TapEvent) -> None: ...
    def cache_event(self, event: CacheEvent) -> None: ...

    def metrics(self) -> dict[str, Any]:
        """Summary exported through the engine's metrics (``Engine.plugin_metrics``)."""
        return {}

    def subscribes(self, point: str) -> bool:
        return getattr(type(self), point) is not getattr(Observer, point)


Fanout = Callable[[Any], None]


def fanout(point: str, observers: list[Any]) -> Fanout | None:
    """One callable calling ``point`` on every observer (None when there are none)."""
    methods = [(o, getattr(o, point)) for o in observers]
    if not methods:
        return None

    def call(event: Any) -> None:
        for observer, method in methods:
            try:
                method(event)
            except Exception:  # an observer never fails the computation it watches
                logger.exception("observer %r failed at hook %s; skipped", getattr(observer, "name", observer), point)

    return call


class HookChain:
    """Per-deployment observer chain: one attribute per hook point, None when unused."""

    request_start: Fanout | None
    request_end: Fanout | None
    artifact_emitted: Fanout | None
    schedule_decision: Fanout | None
    node_start: Fanout | None
    node_end: Fanout | None
    loop_init: Fanout | None
    loop_finalize: Fanout | None
    step_start: Fanout | None
    step_end: Fanout | None
    model_forward_pre: Fanout | None
    model_forward_post: Fanout | None
    cache_event: Fanout | None

    def __init__(self, observers: list[Observer], sources: list[Any] | None = None) -> None:
        """``sources``: every built plugin (observers and interceptors) for ``metrics``;
        interceptors may emit ``cache_event``s through the chain."""
        self.observers = list(observers)
        self.sources = list(sources if sources is not None else observers)
        for point in HOOK_POINTS:
            if point in MODULE_POINTS:
                continue
            setattr(self, point, fanout(point, [o for o in self.observers if o.subscribes(point)]))

    @property
    def subscribed(self) -> list[str]:
        return [p for p in HOOK_POINTS if p not in MODULE_POINTS and getattr(self, p) is not None]

    def metrics(self) -> dict[str, Any]:
        out = {}
        for source in self.sources:
            fn = getattr(source, "metrics", None)
            if callable(fn):
                data = fn()
                if data:
                    out[getattr(source, "name", type(source).__name__)] = data
        return out
