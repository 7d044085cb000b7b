"""Fake stages and factories for scheduler and engine unit tests, in the style of vLLM's
``create_scheduler()`` / ``create_requests()`` (tests/v1/core/test_scheduler.py): no
checkpoint, no model.

A fake pipeline is ``encode`` (a one-shot ``FakeEncode``) then ``loop`` (a ``FakeLoop``).
Each request scripts its own work through ordinary request fields: ``diffusion.steps`` is
its step count and ``(diffusion.height, diffusion.width)`` its "shape": steps batch only
at equal shapes, and a step's FLOPs (the cost model's prior) are ``height * width *
FLOPS_PER_PIXEL``. ``FakeLoop.fail`` makes one request's step fail inside its batch. Every
call a stage runs is appended to a shared ``Calls`` log, so tests read the execution order.

    pipeline, calls = create_pipeline()
    scheduler = create_scheduler(max_batch=4)
    for req in create_requests(pipeline, 3, steps=5):
        scheduler.add(req)
    plan = scheduler.schedule()

``create_engine`` builds the real ``Engine`` on the same pipeline, for what the engine does
with a plan (failure isolation, finish bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.admission import RequestEstimates
from omniloop.engine.memory_budget import MemoryBudget
from omniloop.engine.cost_model import CostModel
from omniloop.engine.request import EngineRequest
from omniloop.engine.scheduler import NodeWork, SchedulerPlan, StepScheduler, StepWork
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stage import LoopStageBase, StageBase, WorkEstimate
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TensorArtifact, TextPart

FLOPS_PER_PIXEL = 1e6  # a step of a 32x32 request: ~1 GFLOP
DEVICE_FLOPS = 1e12  # the fake device: a 32x32 step is predicted at ~1 ms
STATE_BYTES_PER_PIXEL = 4  # held per request (resident_bytes)
PEAK_BYTES_PER_PIXEL = 16  # one step's activations per request (peak_bytes)

Call = tuple[str, tuple[str, ...]]  # (node, request ids) of one forward / step_many


@dataclass
class Calls:
    """Every stage call, in order: ``("encode", ("r0",))``, ``("loop", ("r0", "r1"))``..."""

    log: list[Call] = field(default_factory=list)

    def steps(self) -> list[tuple[str, ...]]:
        """The request ids of every loop step, in order (a batched step lists several)."""
        return [ids for node, ids in self.log if node == "loop"]


@dataclass(kw_only=True)
class FakeLoopState(LoopState):
    shape: tuple[int, int]


@dataclass(eq=False)
class FakeEncode(StageBase):
    calls: Calls
    outputs = {"cond": TensorArtifact}  # type: ignore[assignment]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.calls.log.append((ctx.node, (state.request_id,)))
        ctx.write(state, "cond", TensorArtifact(tensor=torch.zeros(1)))


@dataclass(eq=False)
class FakeLoop(LoopStageBase):
    """``steps_target`` from ``diffusion.steps``; a step adds 1 to ``steps_done``. ``fail``:
    request id -> the step (``steps_done`` before it) whose result is that request's own
    failure, its batch-mates' steps standing (the ``step_many`` contract). ``waiting``: loops
    whose next step cannot run yet (as an AR loop waiting for KV blocks)."""

    calls: Calls
    fail: dict[str, int] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)  # request ids whose next step cannot run yet (``ready``)
    inputs = {"cond": TensorArtifact}  # type: ignore[assignment]
    outputs = {"latents": TensorArtifact}  # type: ignore[assignment]

    def init(self, ctx: StageContext, state: RequestState) -> FakeLoopState:
        self.calls.log.append((f"{ctx.node}.init", (state.request_id,)))
        p = state.request.diffusion
        return FakeLoopState(node=ctx.node, request_id=state.request_id, steps_target=p.steps or 1,
                             shape=(p.height or 32, p.width or 32))

    def step(self, ctx: StageContext, loop: FakeLoopState) -> StepResult:  # type: ignore[override]
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[FakeLoopState]) -> list[StepResult]:  # type: ignore[override]
        self.calls.log.append((ctx.node, tuple(lp.request_id for lp in loops)))
        results = []
        for lp in loops:
            if self.fail.get(lp.request_id) == lp.steps_done:
                results.append(StepResult.failed(RuntimeError(f"scripted failure of {lp.request_id}")))
                continue
            lp.steps_done += 1
            results.append(StepResult(done=lp.done))
        return results

    def finalize(self, ctx: StageContext, loop: FakeLoopState, state: RequestState) -> None:  # type: ignore[override]
        ctx.write(state, "latents", TensorArtifact(tensor=torch.tensor([float(loop.steps_done)])))

    def batch_key(self, loop: FakeLoopState) -> Any:  # type: ignore[override]
        return None if loop.done else (id(self), loop.shape)

    def ready(self, loop: FakeLoopState) -> bool:  # type: ignore[override]
        return loop.request_id not in self.waiting

    def batch_weight(self, loop: FakeLoopState) -> int:  # type: ignore[override]
        return 0 if loop.done else _pixels(loop.shape)  # "tokens": the scheduler's max_batch_tokens counts them

    def step_flops(self, loop: FakeLoopState) -> float | None:  # type: ignore[override]
        return None if loop.done else _pixels(loop.shape) * FLOPS_PER_PIXEL

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        p = state.request.diffusion
        shape = (p.height or 32, p.width or 32)
        return WorkEstimate(steps=p.steps or 1, flops_per_step=_pixels(shape) * FLOPS_PER_PIXEL,
                            resident_bytes=_pixels(shape) * STATE_BYTES_PER_PIXEL,
                            peak_bytes=_pixels(shape) * PEAK_BYTES_PER_PIXEL, batch_group=(id(self), shape))


def _pixels(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def create_pipeline(fail: dict[str, int] | None = None) -> tuple[Pipeline, Calls]:
    calls = Calls()
    spec = PipelineSpec(
        name="fake", family="fake", tasks=frozenset({TaskType.T2V}), components={},
        nodes=(Node("encode", FakeEncode(calls)), Node("loop", FakeLoop(calls, fail=dict(fail or {})))),
        outputs={"latents": "latents"},
    )
    return Pipeline(spec, components={}, device=torch.device("cpu"), dtype=torch.float32), calls


def create_request(rid: str, *, steps: int = 4, shape: tuple[int, int] = (32, 32), priority: int = 0,
                   deadline_s: float | None = None) -> OmniRequest:
    return OmniRequest(request_id=rid, task=TaskType.T2V, inputs=[TextPart(text=rid)], priority=priority,
                       deadline_s=deadline_s, diffusion=DiffusionParams(steps=steps, height=shape[0], width=shape[1]))


def engine_request(pipeline: Pipeline, request: OmniRequest, *, arrival: float) -> EngineRequest:
    """What ``Engine.add_request`` queues: the admitted state, active nodes and estimates."""
    state = pipeline.admit(request)
    nodes = pipeline.active_nodes(state.request)
    return EngineRequest(request=state.request, state=state, nodes=nodes, arrival=arrival,
                         estimates=RequestEstimates.of(pipeline, state, nodes))


def create_requests(pipeline: Pipeline, num: int, *, prefix: str = "r", start: int = 0, arrival: float = 0.0,
                    **kw: Any) -> list[EngineRequest]:
    """``num`` requests ``r0, r1...`` arriving in that order (1 ms apart, from ``arrival``)."""
    return [engine_request(pipeline, create_request(f"{prefix}{start + i}", **kw), arrival=arrival + i * 1e-3)
            for i in range(num)]


def create_scheduler(*, budget_bytes: int = 1 << 30, aging: float = 0.0, **policy: Any) -> StepScheduler:
    """A scheduler over the fake device (``aging=0``: ranks by remaining cost alone)."""
    pol = SchedulingPolicy(aging=aging, **policy)
    return StepScheduler(CostModel(device_flops=DEVICE_FLOPS), MemoryBudget(budget_bytes, max_batch=pol.max_batch), pol)


def run_plan(scheduler: StepScheduler, pipeline: Pipeline, plan: SchedulerPlan) -> list[str]:
    """Execute ``plan`` as the engine would in the plain case (no failures, no events): the
    aborted leave, node work runs or enters its loop, a step runs its batch and finished
    requests leave. Returns the ids that finished."""
    finished = list(plan.aborted)
    for rid in plan.aborted:
        scheduler.remove(rid)
    work = plan.work
    if isinstance(work, NodeWork):
        for rid in work.request_ids:
            req = scheduler.running[rid]
            node, ctx = req.node, pipeline.contexts[work.node]
            if node.is_loop:
                req.loop = node.stage.init(ctx, req.state)
            else:
                node.stage.forward(ctx, req.state)
                req.advance_node()
    elif isinstance(work, StepWork):
        reqs = [scheduler.running[rid] for rid in work.request_ids]
        node, ctx = reqs[0].node, pipeline.contexts[work.node]
        for req, result in zip(reqs, node.stage.step_many(ctx, [r.loop for r in reqs])):
            if result.done:
                node.stage.finalize(ctx, req.loop, req.state)
                req.advance_node()
            if req.node is None:
                scheduler.remove(req.request_id)
                finished.append(req.request_id)
    return finished


def run_to_completion(scheduler: StepScheduler, pipeline: Pipeline, max_plans: int = 1000) -> list[str]:
    """Plans until nothing is left; the order requests finished in."""
    order: list[str] = []
    for _ in range(max_plans):
        if not scheduler.num_unfinished:
            return order
        order += run_plan(scheduler, pipeline, scheduler.schedule())
    raise AssertionError(f"still unfinished after {max_plans} plans: {scheduler.num_unfinished}")


def create_engine(pipeline: Pipeline, *, budget_bytes: int = 1 << 30, **policy: Any) -> Engine:
    return Engine(pipeline, EngineConfig(memory_budget_bytes=budget_bytes, policy=SchedulingPolicy(**policy)))
