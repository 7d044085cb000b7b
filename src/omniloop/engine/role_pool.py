"""Role pools: graph nodes placed on worker processes of their own (design §6.3.4).

Design note (issue 32 item 4). ``DeployConfig.pools`` declares pools by role (``encode`` /
``denoise`` / ``decode``, or ``thinker`` / ``talker`` / ``vocoder``), each a worker process
with its own device; ``DeployConfig.placement`` puts graph nodes on them (a node not placed
runs in the engine's own process, "main"). Nothing in the engine or the scheduler changes:

* **Placed stages.** At launch, each placed node's stage is replaced in rank 0's pipeline by a
  proxy (:class:`PlacedStage` / :class:`PlacedLoop`) with the same ports. Admission-time
  methods (``estimate``, ``check_request``...) run on rank 0's own copy of the stage; the work
  (``forward``, ``init``, ``step_many``, ``finalize``, ``release``) is a :class:`NodeCall` to the
  pool. The scheduler's questions about a loop that lives on a pool (``batch_key``, ``ready``,
  ``step_flops``, ``finite_many``...) read the :class:`LoopView` the pool returned with the
  last call. So rank 0's StepScheduler decides every step of every pool, steps of several
  requests at a placed loop are still one batched ``step_many`` (on the pool), and failure
  isolation, cancel and streaming out of a pool are the engine's as for a local node.
* **Connectors.** The node's input artifacts go to the pool, and its outputs (one-shot
  outputs, ``finalize``'s, a step's emits and stream chunks) come back, through the pool's
  ``Connector`` (engine/connectors.py: shared memory between processes; NCCL / NIXL named
  extension points); the arrival of a transfer is its readiness signal and every transfer
  is measured (``RoleEngine.transfers``: source and target pools, edges, bytes, seconds).
* **Pool to pool.** A placed node's outputs stay in its pool's connector: rank 0 keeps the
  handle (``Packed``: for shared memory, the pickled skeleton and the segment names) in the
  request's artifact table (engine/held_artifacts.py, ``HeldArtifacts``) with the readers the
  graph gives it (:class:`Routes`: the active consumer nodes on pools with the same connector,
  and "main" when a node of rank 0's own, a pool on another connector or the final output
  reads it). A pool reader is sent the handle itself (``CallItem.forwarded``, ``borrowed``:
  it copies out and leaves the segments), so the transfer is (A, B) and rank 0 moves zero
  bytes; rank 0 unpacks an edge only when it reads it. Rank 0 owns the segments it holds and
  unlinks them once: after their last reader, or when the request ends (the engine clears the
  table whatever the ending, a dead pool's included). Stream chunks still route through rank 0
  (its channel counts them for readiness and backpressure; see "Streams across pools").
* **Faults.** A pool whose worker dies is restarted at once (a new process, its pipeline
  rebuilt); the requests whose state it held (the call in flight, loops on it) fail with
  ``pool_failed``-style messages naming the pool, and every other request goes on — including
  later requests on the restarted pool.
* **Streams across pools.** A placed producer's chunks come back with its step's reply onto
  the request's channel (rank 0's). A placed consumer's pool holds a mirror of that channel:
  each call forwards the chunks not yet sent and the end of the stream, and the pool's view
  says how many the loop took, which rank 0's channel then drops — so the engine's readiness
  and backpressure read rank 0's channel exactly as for a local consumer. A consumer that
  waits is sent what came since by ``forward_streams`` (a ``feed`` call), which the scheduler
  calls before it asks ``ready``: ``ready`` itself only reads the view.
* **Limits of this build.** Every process loads the whole pipeline (rank 0 for admission,
  each pool for its nodes); plugins do not run on pools; one process per pool; role pools
  exclude an SPMD ``parallel`` spec.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Hashable, Sequence

import torch

from omniloop.deploy import DeployConfig, PoolSpec
from omniloop.engine.connectors import Connector, Packed, TransferMetric, connector_for, discard
from omniloop.engine.engine import Engine, EngineConfig, EventSink
from omniloop.engine.held_artifacts import MAIN, Held, HeldArtifacts
from omniloop.engine.role_worker import PipelineBuilder, role_worker_main
from omniloop.engine.role_messages import CallItem, CallReply, ItemResult, LoopView, NodeCall, Op, PoolFailed, PoolReady
from omniloop.parallel.launch import process_context
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stage import LoopStageBase, StageBase, WorkEstimate
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.pipeline.streams import EdgeChannel

logger = logging.getLogger(__name__)


class PoolLost(RuntimeError):
    """A pool's worker died; the requests whose state it held fail with this."""


class RolePool:
    """One role pool: its worker process, the pipe to it, and its connector."""

    def __init__(self, name: str, spec: PoolSpec, model: str, deploy: DeployConfig,
                 build: PipelineBuilder | None = None) -> None:
        self.name = name
        self.build = build  # how the worker builds its pipeline (a module-level function); None: load ``model``
        self.spec = spec
        self.model = model
        self.deploy = deploy
        self.connector: Connector = connector_for(spec.connector)
        self.device = torch.device(spec.device)
        self.main_device = torch.device("cpu")  # where what comes back goes (the engine's device; set at launch)
        self.generation = 0  # bumped by every (re)start: loops of an older one are lost
        self.contacted: set[str] = set()  # request ids whose state the current worker holds
        self.transfers: list[TransferMetric] = []
        self._proc: Any = None
        self._conn: Any = None

    def start(self) -> None:
        ctx = process_context(self.device, ("omniloop.engine.role_worker",))
        parent, child = ctx.Pipe()

        self._proc = ctx.Process(target=role_worker_main, name=f"omniloop-pool-{self.name}", daemon=True,
                                 args=(self.name, self.model, self.deploy.model_dump_json(), torch.get_num_threads(),
                                       child, self.build))
        self._proc.start()
        child.close()
        self._conn = parent
        self.generation += 1
        self.contacted = set()
        reply = self._receive("start")
        if not isinstance(reply, PoolReady):
            raise RuntimeError(f"pool {self.name!r} answered {type(reply).__name__} to start")
        logger.info("pool %s up on %s (start %d)", self.name, self.device, self.generation)

    def stop(self, kill: bool = False) -> None:
        if self._proc is None:
            return
        try:
            if not kill and self._conn is not None:
                self._conn.send(None)
        except OSError:
            pass
        if kill and self._proc.exitcode is None:
            self._proc.kill()
        self._proc.join(timeout=10)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- calls -------------------------------------------------------------------------------
    def call(self, op: Op, node: str, items: Sequence[CallItem]) -> CallReply:
        """One node operation on the pool; a dead worker is restarted and :class:`PoolLost` raised."""
        try:
            self._conn.send(NodeCall(op, node, tuple(items)))
            reply = self._receive(f"{op} of node {node!r}")
        except (OSError, EOFError, RuntimeError) as exc:
            for item in items:  # what the dead worker never read (a forwarded handle is rank 0's to free)
                for packed in (item.inputs, item.chunks):
                    if packed is not None:
                        discard(packed)
            self._restart()
            raise PoolLost(f"pool {self.name!r} failed during {op} of node {node!r} ({exc}) and restarted; "
                           "the requests whose state it held fail") from None
        if not isinstance(reply, CallReply):
            raise PoolLost(f"pool {self.name!r} answered {type(reply).__name__} to {op} of node {node!r}")
        self.transfers += reply.received
        return reply

    def _receive(self, what: str) -> Any:
        ready = wait([self._conn, self._proc.sentinel])
        if self._conn in ready:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, PoolFailed):
                raise RuntimeError(f"pool {self.name!r} failed during {what}: {msg.error.strip().splitlines()[-1]}")
            if msg is not None:
                return msg
        self._proc.join(timeout=5)
        raise RuntimeError(f"worker died (exit code {self._proc.exitcode}) during {what}")

    def _restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def pack(self, request_id: str, artifacts: dict[str, Any]) -> Packed:
        return self.connector.pack(request_id, MAIN, artifacts)

    def unpack(self, packed: Packed) -> dict[str, Any]:
        arts, metric = self.connector.unpack(packed, MAIN, self.main_device)
        self.transfers.append(metric)
        return arts

    def item(self, state: RequestState, inputs: dict[str, Any] | None = None,
             forwarded: Sequence[Held] = ()) -> CallItem:
        """A call's item for ``state``'s request: the request itself at first contact (the pool
        then frees it when the request ends), the inputs rank 0 holds through the connector,
        and the handles of other pools' outputs forwarded as they are (pool to pool)."""
        rid = state.request_id
        request = None
        if rid not in self.contacted:
            self.contacted.add(rid)
            request = state.request
            state.releases.append(functools.partial(self.forget, rid, self.generation))
        packed = self.pack(rid, inputs) if inputs else None
        return CallItem(rid, request, packed, forwarded=tuple(h.forwarded() for h in forwarded))

    def forget(self, request_id: str, generation: int) -> None:
        """The request ended: the pool frees what it holds for it (nothing if it restarted since)."""
        if generation != self.generation or request_id not in self.contacted or self._proc is None:
            return
        self.contacted.discard(request_id)
        try:
            self.call("forget", "", [CallItem(request_id)])
        except PoolLost:
            logger.warning("pool %s failed while freeing %s", self.name, request_id)


def _raise(result: ItemResult, pool: RolePool, node: str) -> None:
    if result.error is not None:
        raise RuntimeError(f"node {node!r} on pool {pool.name!r}: {result.error}")


def _reads(node: Node) -> set[str]:
    return {*node.input_edges(), *node.input_edges(optional=True)}


@dataclasses.dataclass(frozen=True)
class Routes:
    """Who reads each edge of the placed pipeline: which pool each node runs on (None: rank 0)
    and the edges the final output names. Rank 0 holds a placed node's outputs as the
    connector's handle for the consumers on pools (engine/held_artifacts.py)."""

    nodes: tuple[Node, ...]
    placement: dict[str, RolePool]  # node -> its pool
    outputs: frozenset[str]

    def readers(self, request: Any, producer: str, edges: Sequence[str], connector: str) -> set[str]:
        """The consumers of ``edges`` for ``request``: a node on a pool with ``connector`` reads
        the handle (by its name); any other reader is rank 0's (MAIN)."""
        wanted, out = set(edges), set()
        for node in self.nodes:
            if node.name == producer or not node.active(request) or not wanted & _reads(node):
                continue
            pool = self.placement.get(node.name)
            out.add(node.name if pool is not None and pool.connector.name == connector else MAIN)
        if wanted & self.outputs:
            out.add(MAIN)
        return out


@dataclasses.dataclass
class _Inputs:
    """What a placed node is sent of its inputs: rank 0's artifacts (packed by its pool's
    connector) and the handles of other pools' outputs (forwarded as they are)."""

    local: dict[str, Any]
    held: list[Held]


def _inputs(node: Node, pool: RolePool, state: RequestState) -> _Inputs:
    """The artifacts node reads that this request has (its required and present optional inputs):
    a handle the node is a reader of goes as it is; anything else rank 0 materializes and sends."""
    arts = state.artifacts
    local: dict[str, Any] = {}
    held: list[Held] = []
    for edge in sorted(_reads(node)):
        if edge not in arts:
            continue
        handle = arts.handle(edge) if isinstance(arts, HeldArtifacts) else None
        if handle is not None and node.name in handle.readers and handle.connector == pool.connector.name:
            if handle not in held:
                held.append(handle)
        else:
            local[edge] = arts[edge]
    return _Inputs(local, held)


def _read(state: RequestState, inputs: _Inputs, node: str) -> None:
    """``node``'s pool has read the forwarded handles: the last reader frees each."""
    arts = state.artifacts
    if isinstance(arts, HeldArtifacts):
        for held in inputs.held:
            arts.read_by(held, node)


class _Placed:
    """Ports and admission-time methods of the node's own stage (rank 0's copy)."""

    local: Any
    node: Node
    pool: RolePool
    routes: Routes

    @property
    def components(self) -> Sequence[str]:
        return self.local.components

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        return self.local.estimate(ctx, state)

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        self.local.check_request(ctx, state, produced)

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        self.local.resolve(ctx, state, produced, defaults)

    def _item(self, state: RequestState, inputs: _Inputs) -> CallItem:
        return self.pool.item(state, inputs.local, inputs.held)

    def _write(self, state: RequestState, packed: Packed | None) -> None:
        """The node's outputs, held as the pool's handle (rank 0 materializes them when it reads them)."""
        if packed is None or not packed.edges:
            return
        if not isinstance(state.artifacts, HeldArtifacts):
            state.artifacts = HeldArtifacts(state.artifacts)
        readers = self.routes.readers(state.request, self.node.name, packed.edges, self.pool.connector.name)
        state.artifacts.hold(Held(packed, self.node.name, self.pool.connector.name, readers, self.pool.unpack))

    def __repr__(self) -> str:
        return f"Placed({self.local!r} on {self.pool.name!r})"


class PlacedStage(_Placed, StageBase):
    """A one-shot node that runs on a pool."""

    @property
    def groups_forward(self) -> bool:
        return self.local.groups_forward

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        inputs = _inputs(self.node, self.pool, state)
        result = self.pool.call("forward", self.node.name, [self._item(state, inputs)]).results[0]
        _raise(result, self.pool, self.node.name)
        _read(state, inputs, self.node.name)
        self._write(state, result.outputs)

    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """One grouped call on the pool; if it fails nothing is written here (the engine retries each alone)."""
        inputs = [_inputs(self.node, self.pool, state) for state in states]
        items = [self._item(state, ins) for state, ins in zip(states, inputs)]
        results = self.pool.call("forward_many", self.node.name, items).results
        for result in results:
            _raise(result, self.pool, self.node.name)
        for state, ins, result in zip(states, inputs, results):
            _read(state, ins, self.node.name)
            self._write(state, result.outputs)


@dataclasses.dataclass(kw_only=True)
class RemoteLoop(LoopState):
    """Rank 0's record of a loop whose state lives on a pool: the pool's last view of it, and
    (a stream consumer) how far its pool's channels mirror rank 0's."""

    view: LoopView
    generation: int  # the pool's start it lives on
    channels: dict[str, EdgeChannel] = dataclasses.field(default_factory=dict)  # rank 0's, of the streams it reads
    forwarded: dict[str, int] = dataclasses.field(default_factory=dict)  # edge -> chunks sent to the pool so far
    told_closed: set[str] = dataclasses.field(default_factory=set)  # edges whose end the pool knows


class PlacedLoop(_Placed, LoopStageBase[RemoteLoop]):
    """A loop node that runs on a pool; the scheduler reads its loops' views."""

    def init(self, ctx: StageContext, state: RequestState) -> RemoteLoop:
        channels = {e: state.channels[e] for e in self.node.stream_input_edges() if e in state.channels}
        streams = RemoteLoop(node=self.node.name, request_id=state.request_id, steps_target=0,
                             view=_NO_VIEW, generation=self.pool.generation, channels=channels)
        inputs = _inputs(self.node, self.pool, state)
        item = dataclasses.replace(self._item(state, inputs), **self._forward_chunks(streams))
        result = self.pool.call("init", self.node.name, [item]).results[0]
        _raise(result, self.pool, self.node.name)
        _read(state, inputs, self.node.name)
        assert result.view is not None
        self._mirror(streams, result.view)
        return streams

    def _forward_chunks(self, loop: RemoteLoop) -> dict[str, Any]:
        """The chunks of the streams the loop reads that its pool has not been sent, and the
        streams that ended since: ``CallItem`` fields (the pool's channels mirror rank 0's)."""
        if not loop.channels:
            return {}
        new = {}
        for edge, channel in loop.channels.items():
            sent = loop.forwarded.get(edge, 0)
            if channel.produced > sent:
                new[edge] = channel.since(sent)
                loop.forwarded[edge] = channel.produced
        closed = tuple(e for e, ch in loop.channels.items() if ch.closed and e not in loop.told_closed)
        loop.told_closed.update(closed)
        return {"chunks": self.pool.pack(loop.request_id, new) if new else None, "closed": closed}

    def _mirror(self, loop: RemoteLoop, view: LoopView) -> None:
        """The pool's view of the loop; rank 0's channels drop the chunks the loop took there."""
        loop.view, loop.steps_done, loop.steps_target = view, view.steps_done, view.steps_target
        for edge, consumed in view.consumed:
            channel = loop.channels[edge]
            channel.take(consumed - channel.consumed)

    def step(self, ctx: StageContext, loop: RemoteLoop) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[RemoteLoop]) -> list[StepResult]:
        lost = [lp.request_id for lp in loops if lp.generation != self.pool.generation]
        if lost:
            raise PoolLost(f"node {self.node.name!r}: pool {self.pool.name!r} restarted since the loop of {lost} "
                           "began there; its state is lost")
        items = [CallItem(lp.request_id, **self._forward_chunks(lp)) for lp in loops]
        reply = self.pool.call("step", self.node.name, items)
        return [self._result(lp, r) for lp, r in zip(loops, reply.results)]

    def _result(self, loop: RemoteLoop, result: ItemResult) -> StepResult:
        if result.error is not None:
            return StepResult.failed(RuntimeError(f"node {self.node.name!r} on pool {self.pool.name!r}: {result.error}"))
        assert result.view is not None
        self._mirror(loop, result.view)
        emitted = self.pool.unpack(result.emitted) if result.emitted is not None else {}
        return StepResult(done=result.done, emit=emitted.get("emit") or None, chunks=emitted.get("chunks") or None)

    def finalize(self, ctx: StageContext, loop: RemoteLoop, state: RequestState) -> None:
        if loop.generation != self.pool.generation:
            raise PoolLost(f"node {self.node.name!r}: pool {self.pool.name!r} restarted; the loop's state is lost")
        result = self.pool.call("finalize", self.node.name, [CallItem(loop.request_id)]).results[0]
        _raise(result, self.pool, self.node.name)
        self._write(state, result.outputs)

    def release(self, loop: RemoteLoop) -> None:
        if loop.generation == self.pool.generation:
            try:
                self.pool.call("release", self.node.name, [CallItem(loop.request_id)])
            except PoolLost:
                logger.warning("pool %s failed while releasing %s", self.pool.name, loop.request_id)

    # -- the scheduler's questions: the pool's last view -------------------------------------
    def batch_key(self, loop: RemoteLoop) -> Hashable | None:
        return None if loop.view.batch_key is None else (self.pool.name, loop.view.batch_key)

    def batch_weight(self, loop: RemoteLoop) -> int:
        return loop.view.batch_weight

    def step_flops(self, loop: RemoteLoop) -> float | None:
        return loop.view.step_flops

    def forward_streams(self, loop: RemoteLoop) -> None:
        """A stream consumer that was not ready when it last heard from its pool is sent the
        chunks (or the end of stream) rank 0 got since, and its view comes back. Without this
        the pool would never learn of them: only a call carries chunks."""
        if loop.view.ready or not self._unsent(loop) or loop.generation != self.pool.generation:
            return
        try:
            result = self.pool.call("feed", self.node.name,
                                    [CallItem(loop.request_id, **self._forward_chunks(loop))]).results[0]
        except PoolLost:  # the pool failed: stepping the loop fails it, naming the pool
            loop.view = dataclasses.replace(loop.view, ready=True)
            return
        if result.view is not None:
            self._mirror(loop, result.view)

    def ready(self, loop: RemoteLoop) -> bool:
        """The pool's last view; a loop its pool lost (restarted since) is ready, so that stepping
        it fails it, naming the pool."""
        return loop.view.ready or loop.generation != self.pool.generation

    @staticmethod
    def _unsent(loop: RemoteLoop) -> bool:
        return any(ch.produced > loop.forwarded.get(e, 0) or (ch.closed and e not in loop.told_closed)
                   for e, ch in loop.channels.items())

    def ready_at(self, loop: RemoteLoop) -> float | None:
        return loop.view.ready_at

    def in_prologue(self, loop: RemoteLoop) -> bool:
        return loop.view.in_prologue

    def is_finite(self, loop: RemoteLoop) -> bool:
        return loop.view.finite

    def starts_from_given(self, ctx: StageContext, produced: frozenset[str]) -> bool:
        return self.local.starts_from_given(ctx, produced)

    def guides_first_chunk(self, ctx: StageContext, produced: frozenset[str]) -> bool:
        return self.local.guides_first_chunk(ctx, produced)

    @property
    def progress_steps(self) -> bool:
        return self.local.progress_steps


_NO_VIEW = LoopView(steps_done=0, steps_target=0, batch_key=None, batch_weight=0, step_flops=None, ready=True,
                   ready_at=None, in_prologue=False)


def placed(node: Node, pool: RolePool, routes: Routes) -> Any:
    """The proxy of ``node``'s stage on ``pool``: a class of its own, so the ports are class
    attributes as every stage's are."""
    local = node.stage
    base = PlacedLoop if node.is_loop else PlacedStage
    cls = type(f"Placed{type(local).__name__}", (base,), {
        "inputs": local.inputs, "optional_inputs": local.optional_inputs, "outputs": local.outputs,
        "stream_inputs": local.stream_inputs, "stream_outputs": local.stream_outputs,
        "params_schema": local.params_schema,
    })
    proxy = cls()
    proxy.local, proxy.node, proxy.pool, proxy.routes = local, node, pool, routes
    return proxy


def check_placement(spec: PipelineSpec, deploy: DeployConfig) -> None:
    """A placement the pipeline can run: every placed node exists."""
    names = [n.name for n in spec.nodes]
    for node_name, pool in deploy.placement.items():
        if node_name not in names:
            raise ValueError(f"placement[{node_name!r}]: pipeline {spec.name!r} has no node {node_name!r}; nodes: "
                             f"{names} (pools: {sorted(deploy.pools)})")


def _check_pool_device(name: str, spec: PoolSpec) -> None:
    """A pool whose device this machine lacks cannot hold its nodes: refused naming the pool."""
    device = torch.device(spec.device)
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    if (device.index or 0) >= count:
        raise ValueError(f"pools[{name!r}].device={spec.device!r}: {count} CUDA device(s) visible to this process; "
                         "pass device='cpu' or a visible device ('cuda:0')")


def place_pipeline(pipeline: Pipeline, placement: dict[str, str], pools: dict[str, RolePool]) -> Pipeline:
    """``pipeline`` with every placed node's stage replaced by its pool proxy."""
    routes = Routes(pipeline.spec.nodes, {n: pools[p] for n, p in placement.items()},
                    frozenset(pipeline.spec.outputs.values()))
    nodes = tuple(dataclasses.replace(n, stage=placed(n, pools[placement[n.name]], routes))
                  if n.name in placement else n for n in pipeline.spec.nodes)
    return dataclasses.replace(pipeline, spec=dataclasses.replace(pipeline.spec, nodes=nodes))


class RoleEngine(Engine):
    """The engine of a deployment with role pools (its pools stop with ``close``)."""

    def __init__(self, pipeline: Pipeline, config: EngineConfig, pools: dict[str, RolePool], *,
                 event_sink: EventSink | None = None) -> None:
        super().__init__(pipeline, config, event_sink=event_sink)
        self.pools = pools
        self._finalizer = weakref.finalize(self, _stop_all, list(pools.values()))

    def transfers(self) -> list[TransferMetric]:
        """Every connector transfer so far, in both directions, by pool."""
        return [t for pool in self.pools.values() for t in pool.transfers]

    def close(self) -> None:
        self._finalizer()


def _stop_all(pools: list[RolePool]) -> None:
    for pool in pools:
        pool.stop()


def launch_role_engine(model: str | Path, deploy: DeployConfig, *, event_sink: EventSink | None = None,
                       pipeline: Pipeline | None = None, build: PipelineBuilder | None = None) -> RoleEngine:
    """Load rank 0's pipeline (or take ``pipeline``, loaded from ``model`` with ``deploy``'s
    options), check the placement, start the pools it uses and return the engine. ``build``:
    how each pool builds its pipeline (a module-level function of (model, deploy, device));
    default: load ``model`` as rank 0 did."""
    from omniloop.engine.async_engine import load_options
    from omniloop.models.loader import load_pipeline

    if pipeline is None:
        pipeline = load_pipeline(model, load_options(deploy))[1]
    check_placement(pipeline.spec, deploy)
    for name, spec in deploy.pools.items():  # before any process starts
        connector_for(spec.connector)
        _check_pool_device(name, spec)
    pools = {name: RolePool(name, deploy.pools[name], str(model), deploy, build)
             for name in sorted(set(deploy.placement.values()))}
    try:
        for pool in pools.values():
            pool.main_device = torch.device(pipeline.device)
            pool.start()
    except BaseException:
        _stop_all(list(pools.values()))
        raise
    return RoleEngine(place_pipeline(pipeline, deploy.placement, pools), EngineConfig.from_deploy(deploy), pools,
                      event_sink=event_sink)


__all__ = ["PlacedLoop", "PlacedStage", "PoolLost", "RoleEngine", "RolePool", "launch_role_engine"]
