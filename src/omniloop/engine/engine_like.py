"""``EngineLike``: the surface ``AsyncEngine`` and the server drive.

``Engine`` (one model) and ``ModelPool`` (several models, one engine each, on one device)
both offer it, so ``AsyncEngine(engine)`` serves either; ``AsyncEngine`` is built with each
(``AsyncEngine.models`` with a pool), so a member one lacks is a type error, not an
``AttributeError`` at serve time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from omniloop.request import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omniloop.engine.checkpoints import LoopCheckpoints
    from omniloop.engine.engine import EngineConfig, EventSink
    from omniloop.pipeline.pipeline import Pipeline


class EngineStatsView(Protocol):
    """The engine's request counters (``EngineStats``; a pool's are its engines' sums)."""

    @property
    def completed(self) -> int: ...

    @property
    def failed(self) -> int: ...

    @property
    def cancelled(self) -> int: ...

    @property
    def pool_restarts(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def batched_steps(self) -> int: ...

    # counted by the engine's callers too (AsyncEngine counts a request it refuses itself)
    rejected: int


class CostSnapshots(Protocol):
    def snapshot(self) -> dict[str, float]:
        """The cost model's calibration, one flat map (``/stats``)."""
        ...


class EngineLike(Protocol):
    """What ``AsyncEngine`` and the server call on the engine they drive."""

    config: EngineConfig
    accepting: bool  # False while draining: new requests are refused
    event_sink: EventSink | None
    checkpoints: LoopCheckpoints | None  # crash checkpoints of running loops (engine/checkpoints.py)

    @property
    def pipeline(self) -> Pipeline:
        """The (default model's) pipeline."""
        ...

    @property
    def stats(self) -> EngineStatsView: ...

    @property
    def cost_model(self) -> CostSnapshots: ...

    def add_request(self, request: OmniRequest, *, paused: bool = False) -> str: ...

    def step(self) -> list[OmniOutput]: ...

    def abort(self, request_id: str, *, forget: bool = False, reason: str | None = None) -> None: ...

    def predicted_backlog_s(self) -> float: ...

    def pop_output(self, request_id: str) -> OmniOutput | None: ...

    def has_unfinished(self) -> bool: ...

    def idle_s(self) -> float | None:
        """Seconds until some work can run (0: now; None: nothing to do)."""
        ...

    def send(self, request_id: str, item: Any) -> None: ...

    def pause(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...

    def is_tracked(self, request_id: str) -> bool: ...

    def tracked_ids(self) -> list[str]: ...

    def num_waiting(self) -> int: ...

    def num_running(self) -> int: ...

    def plugin_metrics(self) -> dict[str, Any]: ...
