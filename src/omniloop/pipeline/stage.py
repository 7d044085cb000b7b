"""The two node protocols the runtime drives.

``Stage``: a one-shot transform (encoders, VAE encode/decode, packers, vocoders).
``LoopStage``: an iterative computation whose iteration the runtime owns: ``init`` once,
``step`` until ``StepResult.done``, then ``finalize``. A loop may offer ``batch_key`` /
``step_many`` so the scheduler can run shape-compatible steps of several requests as one
forward.

The protocols list every method the engine calls; ``StageBase`` / ``LoopStageBase`` give
the optional ones their defaults, so the engine never probes a stage with ``getattr``.
Both loop types are generic over the loop's state: ``class DenoiseLoop(LoopStageBase[DenoiseLoopState])``
takes its own state in ``step`` / ``finalize`` / ``batch_key``...; the engine, which holds
loops of every kind, sees ``LoopStage[Any]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Hashable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from pydantic import BaseModel

from omniloop.pipeline.checkpoint import CheckpointMismatch, CheckpointUnsupported, LoopCheckpoint
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.failures import per_request
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import Artifact


# The state one loop keeps per request (``DenoiseLoopState``, ``ARLoopState``...).
S = TypeVar("S", bound=LoopState)


@dataclass(frozen=True)
class WorkEstimate:
    """What running a node for one request will cost, estimated before it starts (the
    scheduler's cost model and admission's memory budget consume it)."""

    steps: int = 1  # schedulable steps (1 for a one-shot stage)
    flops_per_step: float | None = None  # analytic matmul FLOPs of one step, if known
    resident_bytes: int = 0  # state held while the request is in flight
    # Transient activations of one step of this request alone: all of its rows (a CFG
    # batched step stacks its branches). A batched step of n requests needs n of these.
    peak_bytes: int = 0
    loop_bytes: int = 0  # held only while this node's loop runs (an AR loop's KV cache)
    init_peak_bytes: int = 0  # transient of the loop's ``init`` (e.g. an AR prefill); never batched
    # The batch key this node's steps are predicted to have (``batches_with``): requests of
    # equal groups may share a batched step; None: its steps run alone.
    batch_group: Hashable | None = None
    # bytes charged against named cache pools with budgets of their own (e.g. "chunk_kv"),
    # part of resident_bytes too
    pool_bytes: Mapping[str, int] = field(default_factory=dict)


class _Ports(Protocol):
    # Typed ports: port name -> artifact type. Ports equal edge names unless the Node renames.
    # Read-only: a class attribute or a property (computed from the stage's fields) satisfies them.
    @property
    def inputs(self) -> Mapping[str, type[Artifact]]: ...

    @property
    def optional_inputs(self) -> Mapping[str, type[Artifact]]: ...

    @property
    def outputs(self) -> Mapping[str, type[Artifact]]: ...

    @property
    def components(self) -> Sequence[str]:
        """Names of the components this stage binds (validated against the spec's components)."""
        ...

    @property
    def params_schema(self) -> type[BaseModel] | None:
        """Schema of OmniRequest.node_params[node] for this stage, or None if it takes none."""
        ...


class _StreamPorts(Protocol):
    # Stream ports of a loop (pipeline/streams.py): chunks it emits in ``StepResult.chunks`` /
    # reads through ``ctx.stream``; port name -> chunk type. Empty for a stage that cannot
    # stream (``StageBase``'s default); listed with the methods, so a stage without them is refused.
    @property
    def stream_inputs(self) -> Mapping[str, type[Artifact]]: ...

    @property
    def stream_outputs(self) -> Mapping[str, type[Artifact]]: ...


@runtime_checkable
class Stage(_Ports, _StreamPorts, Protocol):
    """Every method the engine calls on a one-shot node (``StageBase`` gives the defaults)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None: ...

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Cost and memory of running the node for this request, before it runs."""
        ...

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        """Admission: raise a ValueError naming the field when this request cannot run at the
        node (``produced``: the edges the request's active nodes write)."""
        ...

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission, after ``check_request``: fill in the values this node reads that the request
        leaves unset, from ``defaults`` (the node's ``GenerationDefaults``), on ``state.request``
        (``RequestState.resolve_node_params`` for its own knobs), and check them; the node's
        steps then read only resolved values. Loop nodes resolve before one-shot nodes (a text
        stage encodes a negative prompt when a loop guides)."""
        ...

    @property
    def groups_forward(self) -> bool:
        """Whether ``forward_many`` runs a group of requests as one call (the engine then
        runs the requests the scheduler grouped at this node with one ``forward_many``)."""
        ...

    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """The node for requests the scheduler grouped at it (one encoder call for all their
        prompts). It must raise before writing anything (the engine then retries each request
        alone), and each request's outputs must be what ``forward`` gives it, up to the
        batch's arithmetic."""
        ...


@runtime_checkable
class LoopStage(_Ports, _StreamPorts, Protocol[S]):
    """Every method the engine calls on a loop node (``LoopStageBase`` gives the defaults)."""

    def init(self, ctx: StageContext, state: RequestState) -> S: ...

    def step(self, ctx: StageContext, loop: S) -> StepResult: ...

    def finalize(self, ctx: StageContext, loop: S, state: RequestState) -> None: ...

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate: ...

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None: ...

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the node's values resolved (``Stage.resolve``)."""
        ...

    def starts_from_given(self, ctx: StageContext, produced: frozenset[str]) -> bool:
        """Whether the loop starts from given latents in a request producing ``produced`` (a
        ``diffusion.strength`` that no loop of a request can use is refused at admission)."""
        ...

    def step_flops(self, loop: S) -> float | None:
        """Analytic FLOPs of the loop's next step (the cost model's prior; None: unknown)."""
        ...

    def finite_many(self, loops: Sequence[S]) -> list[bool]:
        """Per loop of one batched step: False when its state holds NaN/Inf."""
        ...

    def release(self, loop: S) -> None:
        """Free what ``loop`` holds when it ends without ``finalize`` (cancel, failure)."""
        ...

    def batch_key(self, loop: S) -> Hashable | None:
        """Steps of loops with equal, non-None keys may run as one ``step_many`` call (``batches_with``)."""
        ...

    def step_many(self, ctx: StageContext, loops: Sequence[S]) -> list[StepResult]:
        """One step of each loop. Either it raises before changing any loop (the engine then
        retries each loop alone, so only the culprit fails), or it returns one result per
        loop, where a request's own failure is ``StepResult.failed(exc)`` and the others'
        steps stand (``omniloop.pipeline.failures``)."""
        ...

    def batch_weight(self, loop: S) -> int:
        """What the loop's next step adds to a batch under the scheduler's token budget
        (``SchedulingPolicy.max_batch_tokens``); 0: nothing counted."""
        ...

    def forward_streams(self, loop: S) -> None:
        """Hand the loop the chunks (and stream ends) its input streams got since it last saw
        them, where that takes work: a loop on a role pool is sent them. The scheduler calls it
        before it asks :meth:`ready`, which then only reads."""
        ...

    def ready(self, loop: S) -> bool:
        """False while the loop's next step cannot run (it waits for KV blocks). A query: no side
        effects (what readiness needs delivered, :meth:`forward_streams` delivered)."""
        ...

    def ready_at(self, loop: S) -> float | None:
        """``time.perf_counter()`` before which the next step must not run (None: now)."""
        ...

    def in_prologue(self, loop: S) -> bool:
        """True while the loop's next step is prologue work (an AR loop's prefill chunks)."""
        ...

    def interceptor_support(self, ctx: StageContext) -> frozenset[str]:
        """The plugin interceptor kinds the loop takes at this node: ``"step"``, ``"block"``
        (its model runs its blocks through ``run_blocks``); plugin installation binds by it."""
        ...

    @property
    def progress_steps(self) -> bool:
        """Whether the loop's steps are the request's progress (ProgressEvents, ``RequestMetrics.steps``,
        step plugins); False for a loop that only splits one-shot work into steps (a streamed VAE decode)."""
        ...

    def checkpoint(self, loop: S) -> LoopCheckpoint:
        """The loop's mutable state at this step boundary, as plain tensors and scalars (a
        durable job's crash checkpoint); raises ``CheckpointUnsupported`` saying why not."""
        ...

    def restore(self, ctx: StageContext, loop: S, checkpoint: LoopCheckpoint) -> None:
        """Overwrite a freshly ``init``-ed loop's mutable state with ``checkpoint``'s (a resumed
        job); raises ``CheckpointMismatch`` before changing anything when it does not fit."""
        ...


def batches_with(key: Hashable | None, other: Hashable | None) -> bool:
    """The one rule of batch compatibility: steps of one node run as one ``step_many`` when
    their ``batch_key``s are equal and not None (None: the step runs alone). The scheduler
    batches live steps by it, and admission applies it to the keys it predicts
    (``WorkEstimate.batch_group``) to know whose step activations can stack."""
    return key is not None and key == other


def is_loop(stage: Any) -> bool:
    return callable(getattr(stage, "init", None)) and callable(getattr(stage, "step", None))


class StageBase:
    """Defaults for the declarative port attributes (subclass and override)."""

    inputs: ClassVar[Mapping[str, type[Artifact]]] = {}
    optional_inputs: ClassVar[Mapping[str, type[Artifact]]] = {}
    outputs: ClassVar[Mapping[str, type[Artifact]]] = {}
    stream_inputs: ClassVar[Mapping[str, type[Artifact]]] = {}
    stream_outputs: ClassVar[Mapping[str, type[Artifact]]] = {}
    params_schema: type[BaseModel] | None = None
    if TYPE_CHECKING:  # read-only to the engine: a subclass sets it or computes it from its fields
        @property
        def components(self) -> Sequence[str]: ...
    else:
        components: Sequence[str] = ()

    if TYPE_CHECKING:  # a one-shot subclass defines it; declared for the type checker only, so a
        # stage that lacks it still fails spec validation (``_check_node_shape``) instead of
        # inheriting a default
        def forward(self, ctx: StageContext, state: RequestState) -> None: ...

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Cost/memory estimate before the node runs (override where it matters)."""
        return WorkEstimate()

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        """Admission check of the node for one request (default: none)."""

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: resolve the values the node reads (default: it reads none of its own)."""

    @property
    def groups_forward(self) -> bool:
        """A stage that overrides ``forward_many`` groups requests (override to say otherwise)."""
        return type(self).forward_many is not StageBase.forward_many

    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """Default: ``forward`` for each request in turn (the engine calls it only when
        ``groups_forward``; a stage that batches overrides it)."""
        for state in states:
            self.forward(ctx, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ComponentStage(StageBase):
    """A one-shot stage that runs one named component (``component``: the VAE, a second
    text encoder...), settable per node so two nodes of one stage class can use two."""

    component: str = ""

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)


class LoopStageBase(StageBase, Generic[S]):
    """Defaults of the optional loop methods: no cost prior, always finite, nothing to
    release, no batching (``step_many`` steps the loops one by one, each failure its own)."""

    if TYPE_CHECKING:  # every loop defines these (no defaults: spec validation names a missing one)
        def init(self, ctx: StageContext, state: RequestState) -> S: ...

        def step(self, ctx: StageContext, loop: S) -> StepResult: ...

        def finalize(self, ctx: StageContext, loop: S, state: RequestState) -> None: ...

    def step_flops(self, loop: S) -> float | None:
        """Analytic FLOPs of the loop's next step (None: unknown)."""
        return None

    def is_finite(self, loop: S) -> bool:
        """False when the loop's state holds NaN/Inf (the engine then fails the request)."""
        return True

    def finite_many(self, loops: Sequence[S]) -> list[bool]:
        """``is_finite`` of each loop of one batched step (override to check them with one
        device sync instead of one per loop)."""
        return [self.is_finite(lp) for lp in loops]

    def release(self, loop: S) -> None:
        """Free what ``loop`` holds when it ends without ``finalize`` (cancel, failure)."""

    def starts_from_given(self, ctx: StageContext, produced: frozenset[str]) -> bool:
        """Whether the loop starts from given latents (default: it starts from noise or a prompt)."""
        return False

    def ready_at(self, loop: S) -> float | None:
        """``time.perf_counter()`` before which the loop's next step must not run (a live
        session paced to real time); None: ready now."""
        return None

    def in_prologue(self, loop: S) -> bool:
        """True while the loop's next step is prologue work (an AR loop's prefill chunks): the
        scheduler interleaves it with other requests' steps instead of queueing it behind them."""
        return False

    def forward_streams(self, loop: S) -> None:
        """Nothing to hand over: a loop in this process reads its request's channels directly."""

    def ready(self, loop: S) -> bool:
        """False while the loop's next step cannot run (e.g. it waits for KV blocks after a
        preemption); the scheduler then picks other work."""
        return True

    @property
    def progress_steps(self) -> bool:
        """The loop's steps are the request's progress (a loop that splits one-shot work into
        steps so the scheduler can interleave it says False: it looks like that node outside)."""
        return True

    def batch_key(self, loop: S) -> Hashable | None:
        return None

    def checkpoint(self, loop: S) -> LoopCheckpoint:
        """Default: not checkpointable (a resumed job runs this loop from its first step)."""
        raise CheckpointUnsupported(f"{type(self).__name__} loops are not checkpointed")

    def restore(self, ctx: StageContext, loop: S, checkpoint: LoopCheckpoint) -> None:
        raise CheckpointMismatch(f"{type(self).__name__} loops take no checkpoint (it was written by another graph)")

    def interceptor_support(self, ctx: StageContext) -> frozenset[str]:
        """No plugin interceptors (a loop that runs them says which kinds)."""
        return frozenset()

    def batch_weight(self, loop: S) -> int:
        return 0

    def step_many(self, ctx: StageContext, loops: Sequence[S]) -> list[StepResult]:
        errors: list[BaseException | None] = [None] * len(loops)
        results = per_request(errors, lambda i: self.step(ctx, loops[i]))
        return step_results(results, errors)


def step_results(results: Sequence[StepResult | None], errors: Sequence[BaseException | None]) -> list[StepResult]:
    """Each loop's result of a batched step whose per-loop parts ran through ``per_request``:
    its failure where ``errors`` holds one, else its result (then never None)."""
    return [_result_of(r, e) for r, e in zip(results, errors)]


def _result_of(result: StepResult | None, error: BaseException | None) -> StepResult:
    if error is not None:
        return StepResult.failed(error)
    assert result is not None, "per_request returns None only for a failed request"
    return result
