"""Streaming graph edges (pipeline/streams.py) on tiny loops, through the real Engine: a
``produce`` loop emits one chunk per step on its stream output ``tokens``; a ``consume`` loop
reads them (one per step) and writes their running sum. Declaring ``tokens`` streaming starts
the consumer at the first chunk; the result is the non-streamed one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node, PipelineSpec, PipelineSpecError
from omniloop.pipeline.stage import LoopStageBase, StageBase, WorkEstimate
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.pipeline.streams import EdgeChannel, StreamEdge
from omniloop.request import DiffusionParams, OmniRequest, RequestStatus, TaskType, TensorArtifact, TextPart

Log = list[tuple[str, tuple[str, ...]]]  # (node, request ids) of every step, in order


@dataclass(kw_only=True)
class ProduceState(LoopState):
    made: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Produce(LoopStageBase):
    """``diffusion.steps`` steps; step i emits the chunk [i + seed % 7] on ``tokens``."""

    log: Log
    released: list[str] = field(default_factory=list)
    outputs = {"text": TensorArtifact}  # type: ignore[assignment]
    stream_outputs = {"tokens": TensorArtifact}  # type: ignore[assignment]

    def init(self, ctx: StageContext, state: RequestState) -> ProduceState:
        return ProduceState(node=ctx.node, request_id=state.request_id, steps_target=state.request.diffusion.steps)

    def step(self, ctx: StageContext, loop: ProduceState) -> StepResult:  # type: ignore[override]
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[ProduceState]) -> list[StepResult]:  # type: ignore[override]
        self.log.append((ctx.node, tuple(lp.request_id for lp in loops)))
        out = []
        for lp in loops:
            value = float(lp.steps_done + len(lp.request_id))
            lp.made.append(value)
            lp.steps_done += 1
            out.append(StepResult(done=lp.done, chunks=[("tokens", TensorArtifact(tensor=torch.tensor([value])))]))
        return out

    def finalize(self, ctx: StageContext, loop: ProduceState, state: RequestState) -> None:  # type: ignore[override]
        ctx.write(state, "text", TensorArtifact(tensor=torch.tensor(loop.made)))

    def batch_key(self, loop: ProduceState) -> Any:  # type: ignore[override]
        return id(self)

    def release(self, loop: ProduceState) -> None:  # type: ignore[override]
        self.released.append(loop.request_id)

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        return WorkEstimate(steps=state.request.diffusion.steps, batch_group=id(self))


@dataclass(kw_only=True)
class ConsumeState(LoopState):
    tokens: EdgeChannel
    total: torch.Tensor
    pending_seen: list[int] = field(default_factory=list)  # chunks waiting at each step (backpressure)


@dataclass(eq=False)
class Consume(LoopStageBase):
    """Takes one chunk a step, adds twice its value to a running sum; done when the stream is.
    ``fail``: request id -> the step at which its step fails."""

    log: Log
    fail: dict[str, int] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    stalled: set[str] = field(default_factory=set)  # request ids whose consumer cannot step (it lags)
    outputs = {"audio": TensorArtifact}  # type: ignore[assignment]
    stream_inputs = {"tokens": TensorArtifact}  # type: ignore[assignment]

    def init(self, ctx: StageContext, state: RequestState) -> ConsumeState:
        return ConsumeState(node=ctx.node, request_id=state.request_id, steps_target=1 << 30,
                            tokens=ctx.stream(state, "tokens"), total=torch.zeros(1))

    def step(self, ctx: StageContext, loop: ConsumeState) -> StepResult:  # type: ignore[override]
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[ConsumeState]) -> list[StepResult]:  # type: ignore[override]
        self.log.append((ctx.node, tuple(lp.request_id for lp in loops)))
        out = []
        for lp in loops:
            if self.fail.get(lp.request_id) == lp.steps_done:
                out.append(StepResult.failed(RuntimeError(f"consumer of {lp.request_id} broke")))
                continue
            lp.pending_seen.append(lp.tokens.pending)
            for chunk in lp.tokens.take(1):
                lp.total = lp.total + 2 * chunk.tensor
            lp.steps_done += 1
            out.append(StepResult(done=lp.tokens.exhausted))
        return out

    def finalize(self, ctx: StageContext, loop: ConsumeState, state: RequestState) -> None:  # type: ignore[override]
        ctx.write(state, "audio", TensorArtifact(tensor=loop.total))
        PENDING[loop.request_id] = loop.pending_seen

    def batch_key(self, loop: ConsumeState) -> Any:  # type: ignore[override]
        return id(self)

    def ready(self, loop: ConsumeState) -> bool:  # type: ignore[override]
        return loop.request_id not in self.stalled

    def release(self, loop: ConsumeState) -> None:  # type: ignore[override]
        self.released.append(loop.request_id)


PENDING: dict[str, list[int]] = {}


def _pipeline(*, streams: tuple[StreamEdge, ...] = (), fail: dict[str, int] | None = None
              ) -> tuple[Pipeline, Log, Produce, Consume]:
    log: Log = []
    produce, consume = Produce(log), Consume(log, fail=dict(fail or {}))
    spec = PipelineSpec(name="streamed", family="fake", tasks=frozenset({TaskType.T2A}), components={},
                        nodes=(Node("produce", produce), Node("consume", consume)),
                        outputs={"text": "text", "audio": "audio"}, streams=streams)
    return Pipeline(spec, components={}, device=torch.device("cpu"), dtype=torch.float32), log, produce, consume


def _request(rid: str, steps: int = 5) -> OmniRequest:
    return OmniRequest(request_id=rid, task=TaskType.T2A, inputs=[TextPart(text=rid)],
                       diffusion=DiffusionParams(steps=steps))


def _engine(pipeline: Pipeline) -> Engine:
    return Engine(pipeline, EngineConfig(memory_budget_bytes=1 << 30, policy=SchedulingPolicy(max_batch=8)))


def _run(engine: Engine, *rids: str, steps: int = 5) -> dict[str, Any]:
    for rid in rids:
        engine.add_request(_request(rid, steps))
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    return {rid: engine.pop_output(rid) for rid in rids}


def _first(log: Log, node: str, rid: str) -> int:
    return next(i for i, (n, ids) in enumerate(log) if n == node and rid in ids)


def _last(log: Log, node: str, rid: str) -> int:
    return max(i for i, (n, ids) in enumerate(log) if n == node and rid in ids)


def test_the_streamed_result_equals_the_non_streamed_one_and_the_consumer_starts_before_the_producer_ends():
    plain, plain_log, _, _ = _pipeline()
    streamed, log, _, _ = _pipeline(streams=(StreamEdge("tokens", capacity=2),))
    want = _run(_engine(plain), "r0")["r0"]
    got = _run(_engine(streamed), "r0")["r0"]
    assert want.status is got.status is RequestStatus.COMPLETED
    for name in ("text", "audio"):
        assert torch.equal(got.artifacts[name].tensor, want.artifacts[name].tensor), name
    assert want.artifacts["audio"].tensor.item() == 2 * sum(range(2, 7))  # chunks 2..6 ("r0": len 2)
    assert _first(plain_log, "consume", "r0") > _last(plain_log, "produce", "r0")  # the baseline waits
    assert _first(log, "consume", "r0") < _last(log, "produce", "r0")  # streamed: it does not


def test_a_bounded_edge_makes_the_producer_wait_for_a_lagging_consumer():
    pipeline, log, produce, consume = _pipeline(streams=(StreamEdge("tokens", capacity=2),))
    engine = _engine(pipeline)
    engine.add_request(_request("r0", 6))
    consume.stalled.add("r0")  # the consumer lags: its steps cannot run
    for _ in range(30):
        engine.step()
    assert [n for n, _ in log] == ["produce", "produce"]  # two chunks wait; the producer waits with them
    channel = engine.scheduler.running["r0"].state.channels["tokens"]
    assert channel.pending == 2 and channel.full
    consume.stalled.clear()
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output("r0")
    assert out.status is RequestStatus.COMPLETED and max(PENDING["r0"]) == 2
    want = _run(_engine(_pipeline()[0]), "r0", steps=6)["r0"]
    assert torch.equal(out.artifacts["audio"].tensor, want.artifacts["audio"].tensor)


def test_consumer_steps_of_several_requests_batch():
    pipeline, log, _, _ = _pipeline(streams=(StreamEdge("tokens", capacity=4),))
    outs = _run(_engine(pipeline), "r0", "r1", steps=4)
    assert all(o.status is RequestStatus.COMPLETED for o in outs.values())
    assert ("consume", ("r0", "r1")) in log or ("consume", ("r1", "r0")) in log
    alone, _, _, _ = _pipeline()
    for rid, out in _run(_engine(alone), "r0", "r1", steps=4).items():
        assert torch.equal(outs[rid].artifacts["audio"].tensor, out.artifacts["audio"].tensor)


def test_cancelling_a_streaming_request_stops_every_node_and_the_other_request_finishes():
    pipeline, log, produce, consume = _pipeline(streams=(StreamEdge("tokens", capacity=8),))
    engine = _engine(pipeline)
    engine.add_request(_request("r0", 20))
    engine.add_request(_request("r1", 3))
    for _ in range(50):
        engine.step()
        if any(n == "consume" and "r0" in ids for n, ids in log):
            break
    assert any(r.parent is not None for r in engine.scheduler.running.values())  # r0's consumer runs as a lane
    engine.abort("r0")
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    r0, r1 = engine.pop_output("r0"), engine.pop_output("r1")
    assert r0.status is RequestStatus.CANCELLED and r1.status is RequestStatus.COMPLETED
    assert "r0" in produce.released and "r0" in consume.released  # both loops freed
    assert not engine.scheduler.running and _last(log, "produce", "r0") < len(log)
    steps_after = [ids for n, ids in log[_last(log, "consume", "r0") + 1:] if "r0" in ids]
    assert steps_after == []


def test_a_failing_consumer_fails_its_own_request_only():
    pipeline, _, produce, _ = _pipeline(streams=(StreamEdge("tokens", capacity=2),), fail={"r0": 1})
    outs = _run(_engine(pipeline), "r0", "r1", steps=6)
    assert outs["r0"].status is RequestStatus.FAILED and "consumer of r0 broke" in outs["r0"].failure.message
    assert outs["r1"].status is RequestStatus.COMPLETED
    assert outs["r1"].artifacts["audio"].tensor.item() == 2 * sum(range(2, 8))
    assert "r0" in produce.released  # its producer stopped with it


# -- bad input: refused at build ------------------------------------------------------------


@dataclass(eq=False)
class OneShotTokens(StageBase):
    outputs = {"tokens": TensorArtifact}  # type: ignore[assignment]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ctx.write(state, "tokens", TensorArtifact(tensor=torch.zeros(1)))


@dataclass(eq=False)
class WholeReader(StageBase):
    inputs = {"tokens": TensorArtifact}  # type: ignore[assignment]
    outputs = {"audio": TensorArtifact}  # type: ignore[assignment]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ctx.write(state, "audio", ctx.read(state, "tokens", TensorArtifact))


def _spec(producer: Any, consumer: Any, streams: tuple[StreamEdge, ...]) -> PipelineSpec:
    return PipelineSpec(name="bad", family="fake", tasks=frozenset({TaskType.T2A}), components={},
                        nodes=(Node("speak", producer), Node("vocode", consumer)), outputs={"audio": "audio"},
                        streams=streams)


def test_an_edge_declared_streaming_between_nodes_that_cannot_stream_is_refused_naming_both():
    with pytest.raises(PipelineSpecError, match=r"edge 'tokens' is declared streaming, but node 'speak' -> node "
                                                r"'vocode' cannot stream it: node 'speak' is a one-shot stage"):
        _spec(OneShotTokens(), WholeReader(), (StreamEdge("tokens"),))
    log: Log = []
    with pytest.raises(PipelineSpecError, match=r"node 'speak' -> node 'vocode' cannot stream it: node 'vocode' "
                                                r"is a one-shot stage"):
        PipelineSpec(name="bad", family="fake", tasks=frozenset({TaskType.T2A}), components={},
                     nodes=(Node("speak", Produce(log)), Node("vocode", WholeReader(), inputs={"tokens": "tokens"})),
                     outputs={"audio": "audio"}, streams=(StreamEdge("tokens"),))
    with pytest.raises(PipelineSpecError, match=r"streams declares edge 'codes', which no node produces"):
        _spec(Produce(log), Consume(log), (StreamEdge("codes"),))
    with pytest.raises(ValueError, match=r"capacity=0: pass a capacity of at least 1"):
        StreamEdge("tokens", capacity=0)


@dataclass(kw_only=True)
class RelayState(LoopState):
    tokens: EdgeChannel


@dataclass(eq=False)
class Relay(LoopStageBase):
    """A middle node (the talker): reads ``tokens`` and emits each chunk plus 100 on ``codes``."""

    log: Log
    stream_inputs = {"tokens": TensorArtifact}  # type: ignore[assignment]
    stream_outputs = {"codes": TensorArtifact}  # type: ignore[assignment]

    def init(self, ctx: StageContext, state: RequestState) -> RelayState:
        return RelayState(node=ctx.node, request_id=state.request_id, steps_target=1 << 30,
                          tokens=ctx.stream(state, "tokens"))

    def step(self, ctx: StageContext, loop: RelayState) -> StepResult:  # type: ignore[override]
        self.log.append((ctx.node, (loop.request_id,)))
        chunks = [("codes", TensorArtifact(tensor=c.tensor + 100)) for c in loop.tokens.take(1)]
        loop.steps_done += 1
        return StepResult(done=loop.tokens.exhausted, chunks=chunks)

    def finalize(self, ctx: StageContext, loop: RelayState, state: RequestState) -> None:  # type: ignore[override]
        pass


def test_a_chain_of_streams_runs_all_three_loops_at_once_and_equals_the_non_streamed_chain():
    def build(streams: tuple[StreamEdge, ...]) -> tuple[Pipeline, Log]:
        log: Log = []
        spec = PipelineSpec(name="chain", family="fake", tasks=frozenset({TaskType.T2A}), components={},
                            nodes=(Node("thinker", Produce(log)), Node("talker", Relay(log)),
                                   Node("vocoder", Consume(log), inputs={"tokens": "codes"})),
                            outputs={"text": "text", "audio": "audio"}, streams=streams)
        return Pipeline(spec, components={}, device=torch.device("cpu"), dtype=torch.float32), log

    plain, _ = build(())
    streamed, log = build((StreamEdge("tokens", capacity=2), StreamEdge("codes", capacity=2)))
    want = _run(_engine(plain), "r0", "r1", steps=5)
    got = _run(_engine(streamed), "r0", "r1", steps=5)
    for rid in ("r0", "r1"):
        assert got[rid].status is RequestStatus.COMPLETED
        assert torch.equal(got[rid].artifacts["audio"].tensor, want[rid].artifacts["audio"].tensor)
    assert _first(log, "vocoder", "r0") < _last(log, "thinker", "r0")  # the last node began before the first ended


def test_a_pool_restart_mid_stream_requeues_the_request_without_its_lanes_and_it_finishes_equal():
    from omniloop.engine.errors import PoolFatalError

    pipeline, log, _, consume = _pipeline(streams=(StreamEdge("tokens", capacity=2),))
    engine = _engine(pipeline)
    engine.add_request(_request("r0", 5))
    fired: list[bool] = []
    step_many = consume.step_many

    def fatal_once(ctx: StageContext, loops: Sequence[ConsumeState]) -> list[StepResult]:
        if not fired and loops[0].steps_done == 1:  # the device goes away mid-stream, once
            fired.append(True)
            raise PoolFatalError("device lost")
        return step_many(ctx, loops)

    consume.step_many = fatal_once  # type: ignore[method-assign]
    consume.step = lambda ctx, loop: fatal_once(ctx, [loop])[0]  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output("r0")
    assert engine.stats.pool_restarts == 1 and out.status is RequestStatus.COMPLETED
    want = _run(_engine(_pipeline()[0]), "r0", steps=5)["r0"]
    assert torch.equal(out.artifacts["audio"].tensor, want.artifacts["audio"].tensor)


def test_under_fifo_the_consumer_also_runs_before_the_producer_ends():
    pipeline, log, _, _ = _pipeline(streams=(StreamEdge("tokens", capacity=8),))
    engine = Engine(pipeline, EngineConfig(memory_budget_bytes=1 << 30, policy=SchedulingPolicy(kind="fifo")))
    out = _run(engine, "r0", steps=5)["r0"]
    assert out.status is RequestStatus.COMPLETED
    assert _first(log, "consume", "r0") < _last(log, "produce", "r0")


def test_a_caller_that_goes_away_mid_stream_leaves_nothing_behind():
    pipeline, log, produce, consume = _pipeline(streams=(StreamEdge("tokens", capacity=2),))
    engine = _engine(pipeline)
    engine.add_request(_request("r0", 30))
    while not any(n == "consume" for n, _ in log):
        engine.step()
    state = engine.scheduler.running["r0"].state
    engine.abort("r0", forget=True)  # what AsyncEngine does when a client disconnects
    engine.step()
    assert engine.tracked_ids() == [] and not engine.scheduler.running and not engine.has_unfinished()
    assert produce.released == ["r0"] and consume.released == ["r0"]
    assert state.channels == {} and state.loops == {} and state.artifacts == {}


def test_a_stream_edge_read_by_two_nodes_is_refused():
    log: Log = []
    with pytest.raises(PipelineSpecError, match=r"stream edge 'tokens' is read by nodes \['a', 'b'\]; one node "
                                                r"consumes a stream"):
        PipelineSpec(name="bad", family="fake", tasks=frozenset({TaskType.T2A}), components={},
                     nodes=(Node("speak", Produce(log)), Node("a", Consume(log)),
                            Node("b", Consume(log), outputs={"audio": "audio2"})),
                     outputs={"audio": "audio"})
