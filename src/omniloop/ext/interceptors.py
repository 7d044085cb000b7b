"""Interceptors (tier 2, compute-altering) and their per-request, per-branch state.

Two explicit extension points, never monkeypatching (design §11.10):

* :class:`StepInterceptor` — before a loop step, may supply the prediction of some or all
  guidance branches (skipping their forward); after it, sees every branch's prediction.
* :class:`BlockInterceptor` — runs the model's block stack through ``run_blocks`` and
  decides, per batch row, which blocks run; substitutes cached or extrapolated residuals.

State scoping is the correctness fix: an interceptor object is shared by the deployment
and holds no request state. Its state for one request is a :class:`PluginLoopState` in
``LoopState.plugin_states[name]``, holding one state per (expert component, CFG branch).

Batched steps (NOTE, the documented choice): a forward may stack several requests and
branches. Decisions are taken per *segment* (the rows of one request-branch): a block
interceptor runs the always-computed blocks on the whole batch, decides per segment, runs
the skippable blocks only on the rows that compute (a row subset, re-batched), and
fills the others from their own cached residuals. A step interceptor's supplied branches
simply leave the forward batch. So batching never mixes two requests' cache decisions,
and a batch where every row computes runs exactly the plain block loop.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from pydantic import BaseModel

from omniloop.ext.plugin import Declarations
from omniloop.ext.scope import ForwardScope, Segment, current_scope, using_scope
from omniloop.models.layers.run_blocks import BlockCall

Prediction = dict[str, torch.Tensor]  # modality -> model output (float32)
BranchKey = tuple[str, str]  # (expert component, guidance branch)
Emit = Callable[[str, "BlockSegment"], None] | None  # (cache event kind, segment)


@dataclass
class PluginLoopState:
    """One interceptor's state for one request (lives in ``LoopState.plugin_states``)."""

    plugin: str
    config: Any  # the effective config of this request (deploy config + request params)
    branches: dict[BranchKey, Any] = field(default_factory=dict)
    forwards: int = 0  # branch forwards seen
    skipped: int = 0  # branch forwards skipped (fully or partly served from cache)

    def branch(self, key: BranchKey, factory: Callable[[], Any]) -> Any:
        state = self.branches.get(key)
        if state is None:
            state = self.branches[key] = factory()
        return state

    def nbytes(self) -> int:
        return sum(getattr(s, "nbytes", lambda: 0)() for s in self.branches.values())


@dataclass(frozen=True, slots=True)
class BlockSegment:
    """The rows of one (request, branch) in one forward, with that branch's state."""

    segment: Segment
    state: Any  # the branch state; None: the plugin is off for this request (always compute)
    config: Any
    steps_target: int
    loop_state: PluginLoopState | None

    @property
    def rows(self) -> slice:
        return slice(self.segment.start, self.segment.stop)


class InterceptorBase:
    """Shared plumbing: the deploy config, the request schema, per-request config."""

    name: str = "interceptor"
    declarations: Declarations
    request_schema: type[BaseModel] | None = None
    sp_group: Any = None

    def __init__(self, name: str, config: Any, *, request_schema: type[BaseModel] | None = None, sp_group: Any = None) -> None:
        self.name = name
        self.config = config
        self.request_schema = request_schema
        self.sp_group = sp_group
        self.totals = {"requests": 0, "forwards": 0, "skipped": 0}
        self.stats: deque[float] = deque(maxlen=4096)  # recent decision statistics (diffs), for calibration

    def request_config(self, params: BaseModel | None, steps: int) -> Any | None:
        """The config one request runs with; None turns the plugin off for it."""
        if steps < self.declarations.min_steps:
            return None  # too few steps for a distribution-altering cache (distilled sampling)
        if params is None:
            return self.config
        updates = {k: v for k, v in params.model_dump(exclude_unset=True).items() if v is not None}
        if updates.pop("enabled", True) is False:
            return None
        if not updates:
            return self.config
        return type(self.config).model_validate({**self.config.model_dump(), **updates})

    def new_branch_state(self) -> Any:
        raise NotImplementedError

    def record(self, loop_state: PluginLoopState, skipped: bool) -> None:
        loop_state.forwards += 1
        loop_state.skipped += skipped
        self.totals["forwards"] += 1
        self.totals["skipped"] += skipped

    def commit(self, segments: Sequence[BlockSegment], reused: Sequence[bool], emit: Emit,
               store: Callable[[int, BlockSegment], None]) -> None:
        """After the forward went through: each request's segment records whether it reused its
        cache (a hit) and reports it, and one that computed stores its fresh residuals
        (``store(i, segment)``). Segments of requests with the plugin off are passed over."""
        for i, seg in enumerate(segments):
            if seg.loop_state is None:  # the plugin is off for this request (no branch state either)
                continue
            self.record(seg.loop_state, reused[i])
            if emit is not None:
                emit("hit" if reused[i] else "miss", seg)
            if not reused[i]:
                store(i, seg)

    def metrics(self) -> dict[str, Any]:
        t: dict[str, Any] = dict(self.totals)
        t["skip_ratio"] = round(t["skipped"] / t["forwards"], 4) if t["forwards"] else 0.0
        if self.stats:
            values = sorted(self.stats)
            t["stat_quantiles"] = {q: values[min(len(values) - 1, int(q * len(values)))] for q in (0.1, 0.25, 0.5, 0.75, 0.9)}
        return t


class StepInterceptor(Protocol):
    name: str
    declarations: Declarations

    def request_config(self, params: BaseModel | None, steps: int) -> Any | None: ...

    def before_step(self, view: "StepView") -> dict[str, Prediction] | None:
        """Predictions of the branches to skip this step (None or {}: run them all)."""
        ...

    def after_step(self, view: "StepView", preds: Mapping[str, Prediction], supplied: frozenset[str]) -> None:
        """Every branch's prediction of this step (``supplied`` ones came from before_step)."""
        ...


class BlockInterceptorPlugin(Protocol):
    name: str
    declarations: Declarations

    def request_config(self, params: BaseModel | None, steps: int) -> Any | None: ...

    def new_branch_state(self) -> Any: ...

    def run_segments(
        self, call: BlockCall, hidden: torch.Tensor, segments: Sequence[BlockSegment], emit: Emit
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StepView:
    """What a step interceptor sees of one loop at one step."""

    loop: Any  # LoopState, read-only except through ``state``
    component: str  # the expert running this step
    branches: tuple[str, ...]
    state: PluginLoopState


class SegmentedBlockRun:
    """The run_blocks interceptor of one forward: a plugin plus the forward's segments."""

    __slots__ = ("plugin", "segments", "emit")

    def __init__(self, plugin: BlockInterceptorPlugin, segments: Sequence[BlockSegment], emit: Emit) -> None:
        self.plugin = plugin
        self.segments = segments
        self.emit = emit

    def run(self, blocks: Sequence[Any], hidden: torch.Tensor, call: BlockCall) -> torch.Tensor:
        with rollback_on_error(self.segments):
            return self.plugin.run_segments(call, hidden, self.segments, self.emit)


# -- helpers for block interceptors ------------------------------------------------------


@contextlib.contextmanager
def rollback_on_error(segments: Sequence[BlockSegment]) -> Iterator[None]:
    """Restore the segments' branch states if the forward raises: the engine retries a
    failed batched step request by request, and a retry must see the state as it was."""
    saved = [(seg.state, {k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in vars(seg.state).items()})
             for seg in segments if seg.state is not None]
    try:
        yield
    except BaseException:
        for state, fields in saved:
            vars(state).update(fields)
        raise


def run_rows(
    call: BlockCall, start: int, stop: int, hidden: torch.Tensor, segments: Sequence[BlockSegment], compute: Sequence[bool]
) -> torch.Tensor | None:
    """Blocks ``start..stop-1`` on the rows of the segments marked ``compute``, packed in
    segment order (None when no segment computes). When every segment computes this is
    exactly ``call.range`` on the whole batch."""
    if all(compute):
        return call.range(start, stop, hidden)
    chosen = [i for i, c in enumerate(compute) if c]
    if not chosen:
        return None
    rows = torch.cat([torch.arange(segments[i].segment.start, segments[i].segment.stop) for i in chosen])
    scope = current_scope()
    with using_scope(scope.subset(chosen) if scope is not None else None):
        return call.subset(rows).range(start, stop, hidden.index_select(0, rows.to(hidden.device)))


def assemble(
    segments: Sequence[BlockSegment],
    compute: Sequence[bool],
    computed: torch.Tensor | None,
    fill: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """The full batch: computed rows from ``computed`` (packed), the others from ``fill(i)``."""
    if all(compute):
        assert computed is not None
        return computed
    parts, offset = [], 0
    for i, seg in enumerate(segments):
        if compute[i]:
            assert computed is not None
            parts.append(computed[offset : offset + seg.segment.rows])
            offset += seg.segment.rows
        else:
            parts.append(fill(i))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def rows_of(tensor: torch.Tensor, seg: BlockSegment, batch: int) -> torch.Tensor:
    """The segment's rows as a tensor that does not pin the whole batch in memory."""
    part = tensor[seg.rows]
    return part if seg.segment.rows == batch else part.clone()


def scope_for(node: str, component: str, calls: Sequence[tuple[str, str, int]], sizes: Sequence[int]) -> ForwardScope:
    """The scope of a forward over ``calls`` = (request_id, branch, step) with ``sizes`` rows each."""
    segments, start = [], 0
    for (rid, branch, step), n in zip(calls, sizes):
        segments.append(Segment(rid, branch, step, start, start + n))
        start += n
    return ForwardScope(node, component, tuple(segments))


def accepts_block_interceptor(model: Any) -> bool:
    """Capability negotiation: the model runs its blocks through ``run_blocks`` and takes
    ``block_interceptor=`` in its forward (a family that has not converted does not)."""
    import inspect

    forward = getattr(model, "forward", None)
    if forward is None:
        return False
    try:
        return "block_interceptor" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
