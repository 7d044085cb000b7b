"""Runtime-owned state: per request (``RequestState``), per loop (``LoopState``), the
per-node ``StageContext`` and the ``StepResult`` a loop step returns.

Nothing mutable per request lives on a module or any object shared between requests:
samplers, policies and plugins keep their state here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch

from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.streams import EdgeChannel
from omniloop.request import Artifact, Failure, OmniRequest, RequestMetrics, RequestStatus

A = TypeVar("A", bound=Artifact)


@dataclass(frozen=True, kw_only=True)
class StageContext:
    """A node's view of the deployment, built once per node at pipeline build.

    Shared by every request that runs the node, hence frozen and free of request state.
    ``inputs``/``outputs`` map the stage's port names to graph edge names.
    """

    node: str
    components: Mapping[str, Any]  # name -> resident module/tokenizer/sampler (shared by reference)
    device: torch.device
    dtype: torch.dtype
    inputs: Mapping[str, str] = field(default_factory=dict)
    outputs: Mapping[str, str] = field(default_factory=dict)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # the node's generation defaults
    # deployment caches shared by every request (name -> cache: "text_embeddings", "adapters"); a
    # stage finds its cache here or runs without it
    caches: Mapping[str, Any] = field(default_factory=dict)
    hooks: Any = None  # observer chain assembled at build (extension system); None costs nothing
    parallel: Any = None  # a pool's row placement (omniloop.parallel.rows: dp x cfg forwards); None: one rank

    def component(self, name: str) -> Any:
        try:
            return self.components[name]
        except KeyError:
            raise KeyError(f"node {self.node!r} needs component {name!r}, which is not loaded") from None

    # Port-level access to the request's edge artifacts.
    def read(self, state: "RequestState", port: str, kind: type[A] = Artifact) -> A:  # type: ignore[assignment]
        return state.get(self.inputs.get(port, port), kind, reader=self.node)

    def read_optional(self, state: "RequestState", port: str, kind: type[A] = Artifact) -> A | None:  # type: ignore[assignment]
        edge = self.inputs.get(port, port)
        return state.get(edge, kind, reader=self.node) if edge in state.artifacts else None

    def write(self, state: "RequestState", port: str, artifact: Artifact) -> None:
        state.put(self.outputs.get(port, port), artifact, node=self.node)

    def stream(self, state: "RequestState", port: str) -> EdgeChannel:
        """The chunk channel of stream input ``port`` (``stream_inputs``; see pipeline/streams.py)."""
        edge = self.inputs.get(port, port)
        try:
            return state.channels[edge]
        except KeyError:
            raise RuntimeError(f"node {self.node!r} reads stream edge {edge!r}, which no active node of this "
                               f"{state.request.task.value!r} request streams") from None


@dataclass(kw_only=True)
class LoopState:
    """Everything mutable about one loop of one request (one progress counter: STYLE.md 2)."""

    node: str
    request_id: str
    steps_target: int
    steps_done: int = 0
    policy_states: dict[str, Any] = field(default_factory=dict)  # policy slot -> its per-request state
    plugin_states: dict[str, Any] = field(default_factory=dict)  # plugin name -> its per-request state
    step_times: list[float] = field(default_factory=list)  # measured wall seconds per step

    @property
    def done(self) -> bool:
        return self.steps_done >= self.steps_target


@dataclass(kw_only=True)
class StepResult:
    done: bool
    emit: list[tuple[str, Artifact]] | None = None  # (name, partial artifact) streamed now
    # This request's own failure in a batched step (its batch-mates' results stand); the
    # engine fails the request with it. See ``omniloop.pipeline.failures``.
    error: BaseException | None = None
    # chunks for the loop's stream outputs (``stream_outputs`` port, chunk), in order: the engine
    # puts them on the request's edge channels (pipeline/streams.py)
    chunks: list[tuple[str, Artifact]] | None = None

    @classmethod
    def failed(cls, error: BaseException) -> "StepResult":
        return cls(done=False, error=error)


@dataclass(kw_only=True)
class RequestState:
    """Runtime-owned mutable state of one request."""

    request: OmniRequest
    status: RequestStatus = RequestStatus.QUEUED
    artifacts: dict[str, Artifact] = field(default_factory=dict)  # edge name -> artifact
    loops: dict[str, LoopState] = field(default_factory=dict)  # node name -> live loop state
    node_params: dict[str, Any] = field(default_factory=dict)  # node -> validated override model
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    ext: Any = None  # optional typed per-family extension (a dataclass the family registers)
    failure: Failure | None = None  # why it ended without its result
    # the request's one lifecycle record (the engine's EngineRequest reads it): perf_counter times
    started_at: float | None = None
    finished_at: float | None = None
    # live inputs a running request's loop takes (a session's actions, prompts, flushes), in
    # order; the engine appends (Engine.send), the loop consumes at its next chunk or step
    inbox: deque = field(default_factory=deque)
    # references the request holds on shared cache entries (text embeddings, adapters); the
    # runtime calls them once when the request ends, whatever the ending
    releases: list[Callable[[], None]] = field(default_factory=list)
    # the request's LoRAs on the device, per component they patch (component -> adapter set),
    # acquired from the deployment's adapter cache by its first node that applies them
    adapters: dict[str, Any] | None = None
    # stream edge -> its chunk channel (pipeline/streams.py), opened at admission
    channels: dict[str, EdgeChannel] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def resolve_node_params(self, node: str, knobs: Any) -> None:
        """Admission (``Stage.resolve``): ``knobs`` (the node's ``params_schema`` model, the
        caller's values with the node's defaults filled in) are what the node reads, and the
        resolved request carries them (``request.node_params[node]``: the caller's and the
        filled fields), so a job reports the values used and re-admitting it resolves the same."""
        self.node_params[node] = knobs
        raw = knobs.model_dump(exclude_unset=True)
        if self.request.node_params.get(node) != raw:
            self.request = self.request.model_copy(update={"node_params": {**self.request.node_params, node: raw}})

    def resolve_diffusion(self, **fill: Any) -> None:
        """Admission: ``request.diffusion`` fields a node resolved (e.g. the negative prompt its
        text stage encodes), set on the resolved request."""
        p = self.request.diffusion
        if any(getattr(p, k) != v for k, v in fill.items()):
            self.request = self.request.model_copy(update={"diffusion": p.model_copy(update=fill)})

    def put(self, edge: str, artifact: Artifact, *, node: str) -> None:
        artifact.node = node
        self.artifacts[edge] = artifact

    def get(self, edge: str, kind: type[A] = Artifact, *, reader: str = "?") -> A:  # type: ignore[assignment]
        try:
            art = self.artifacts[edge]
        except KeyError:
            raise RuntimeError(
                f"node {reader!r} reads edge {edge!r}, which no node has produced for task {self.request.task.value!r}"
            ) from None
        assert isinstance(art, kind), f"edge {edge!r} holds {type(art).__name__}, node {reader!r} expects {kind.__name__}"
        return art

    def release_refs(self) -> None:
        """Drop every shared-cache reference the request holds (idempotent)."""
        releases, self.releases = self.releases, []
        for release in releases:
            release()

    def mark_started(self) -> float:
        """Running from now (once); returns when it started."""
        if self.started_at is None:
            self.started_at = time.perf_counter()
            self.status = RequestStatus.RUNNING
        return self.started_at

    def mark_finished(self, status: RequestStatus, failure: Failure | None) -> float:
        """Ended with ``status`` (and why, if it failed or was cancelled); returns when."""
        assert status.finished, f"mark_finished takes a final status, got {status.value!r}"
        self.status, self.failure, self.finished_at = status, failure, time.perf_counter()
        return self.finished_at

    def requeue(self) -> None:
        """Back to waiting (a pool restart): not started, not finished."""
        self.status, self.started_at, self.finished_at = RequestStatus.QUEUED, None, None
