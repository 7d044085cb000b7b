"""One rank of an SPMD pool: how every rank builds its pipeline, and the loop ranks 1..N-1
run — receive rank 0's plan, execute the same work on this rank's shard, answer.

A follower never schedules: it mirrors rank 0's decisions (admissions, aborts, failures)
and runs the same ``Engine`` execution code, so its request states advance in lockstep
with rank 0's; the collectives inside the steps (sequence / tensor / row parallel) pair up
because every rank runs the same forwards in the same order.

Importing this module also imports every model family, so the forkserver that forks the
ranks has done it once (a fork then starts in well under a second).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from omniloop.deploy import DeployConfig
from omniloop.engine.admission import admit
from omniloop.engine.async_engine import load_options
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.errors import PoolFatalError
from omniloop.engine.pool_messages import PlanMessage, Query, RankFailed, RankOutcome, RankReady, plan_digest
from omniloop.engine.request import EngineRequest
from omniloop.engine.scheduler import SchedulerPlan, SchedulingPolicy
from omniloop.engine.worker_loop import WorkerPipe, die, serve_messages
from omniloop.ext.install import install_plugins
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import ModelSpec, discover_families
from omniloop.parallel import launch
from omniloop.parallel.apply import parallelize_pipeline
from omniloop.parallel.mesh import ParallelMesh, init_process_group
from omniloop.parallel.plan import parallel_plan
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import Failure, OmniRequest, RequestStatus

_UNBOUNDED = 1 << 62


def rank_device(deploy: DeployConfig, rank: int) -> torch.device:
    return launch.rank_device(deploy.torch_device(), rank)


def join_pool(deploy: DeployConfig, rank: int, port: int, store: Any = None) -> ParallelMesh:
    """Join the pool's process group and build this rank's mesh (collective: every rank calls it)."""
    spec = deploy.parallel
    device = rank_device(deploy, rank)
    init_process_group(rank, spec.world, port, device, spec.timeout_s, store=store)
    return ParallelMesh.build(spec, device)


def build_rank_pipeline(model: Any, deploy: DeployConfig, mesh: ParallelMesh) -> tuple[ModelSpec, Pipeline]:
    """Load, parallelize (the family's plan), install the deployment's plugins (their decision
    statistics reduced over the sp group)."""
    options = dataclasses.replace(load_options(deploy), device=rank_device(deploy, mesh.rank))
    model_spec, pipeline = load_pipeline(model, options)
    plan = parallel_plan(model_spec)
    assert plan is not None, "the pre-flight check refuses a pool for a family without a parallel plan"
    pipeline = parallelize_pipeline(pipeline, plan, mesh)
    pipeline = install_plugins(pipeline, deploy.plugins, compile=pipeline.compiled, sp_group=mesh.group("sp"))
    return model_spec, pipeline


def is_collective_error(exc: BaseException | None) -> bool:
    """An error of the process group itself (a peer died, a timeout): pool-fatal.

    NOTE: gloo reports a peer that stopped answering ("Timed out waiting 3000ms for send
    operation to complete") or went away as a plain RuntimeError, not a ``DistError``; what
    marks it is where it was raised: inside a ``torch.distributed`` call. Such a failure
    says nothing about the request (every rank's state is suspect), so it is pool-fatal too.
    """
    if exc is None:
        return False
    if isinstance(exc, (dist.DistError, PoolFatalError)):
        return True
    return _raised_in_torch_distributed(exc)


_DISTRIBUTED_DIR = os.path.dirname(dist.__file__) + os.sep


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    """Whether the innermost Python frame of ``exc``'s traceback is torch.distributed's code
    (a collective's ``work.wait()``, a send or receive)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_DISTRIBUTED_DIR)


class FollowerEngine(Engine):
    """Executes the plans rank 0 decides; admission limits are rank 0's business."""

    def __init__(self, pipeline: Pipeline, deploy: DeployConfig, rank: int) -> None:
        config = EngineConfig(max_queue=_UNBOUNDED, memory_budget_bytes=_UNBOUNDED, nan_check=deploy.nan_check,
                              policy=SchedulingPolicy(max_running=_UNBOUNDED, max_batch=_UNBOUNDED))
        super().__init__(pipeline, config)
        self.rank = rank
        self._ended: list[tuple[str, str, Failure | None]] | None = None

    def run(self, msg: PlanMessage) -> RankOutcome:
        for rid, failure in msg.failed:  # request-fatal on some rank: end it here too
            req = self.scheduler.find(rid)
            if req is not None:
                self._finish(req, RequestStatus.FAILED, failure)
        for request in msg.requests:
            self._adopt(request)
        plan = msg.plan
        self._mirror(plan)
        self._apply_plan_boundaries(plan)
        digest = plan_digest(plan, self.scheduler) if msg.check else None
        self._ended = []
        try:
            self._run_plan(plan)
            ended = tuple(self._ended)
        finally:
            self._ended = None
        for rid in list(self._finished):  # rank 0 returns the outputs; here they are only freed
            self.pop_output(rid)
        return RankOutcome(self.rank, digest, ended)

    def answer(self, query: Query) -> Any:
        """Read-only views for rank 0 (debugging, tests, per-rank metrics)."""
        if query.name == "plugin_metrics":
            return self.plugin_metrics()
        if query.name == "requests":  # what this rank holds: it must mirror rank 0's scheduler
            return {"running": sorted(self.scheduler.running), "waiting": sorted(r.request_id for r in self.scheduler.waiting),
                    "steps": {rid: r.loop.steps_done for rid, r in self.scheduler.running.items() if r.loop is not None}}
        raise ValueError(f"unknown pool query {query.name!r}; pass 'plugin_metrics' or 'requests'")

    def _adopt(self, request: OmniRequest) -> None:
        """Rank 0 admitted ``request``: the same admission here, without the queue and memory limits."""
        req = self._track(admit(self.pipeline, request))  # the remaining-cost view the engine keeps per request
        self._requests[request.request_id] = req
        self.scheduler.add(req)

    def _mirror(self, plan: SchedulerPlan) -> None:
        """Apply rank 0's admissions to this scheduler (its memory and ranking are unused)."""
        sched = self.scheduler
        sched.iteration = plan.iteration
        for rid in plan.admitted:
            req = next((r for r in sched.waiting if r.request_id == rid), None)
            assert req is not None, f"rank {self.rank}: plan {plan.iteration} admits {rid!r}, which it never received"
            sched.memory.reserve(rid, req.memory)  # unbounded here; kept so releases balance
            sched.waiting.remove(req)
            sched.running[rid] = req

    def _finish(self, req: EngineRequest, status: RequestStatus, failure: Failure | None) -> None:
        if self._ended is not None and not req.is_finished:
            self._ended.append((req.request_id, status.value, failure))
        super()._finish(req, status, failure)

    def _fail(self, req: EngineRequest, exc: BaseException) -> None:
        if is_collective_error(exc):
            raise PoolFatalError(f"rank {self.rank}: collective failed: {exc}") from exc
        super()._fail(req, exc)


def worker_main(rank: int, model: str, deploy_json: str, port: int, threads: int, conn: Any) -> None:
    """The process of rank ``rank`` (1..N-1): build, then serve plans until rank 0 says stop
    (``None``) or goes away (the pipe closes)."""
    pipe = WorkerPipe(conn, f"rank {rank}", functools.partial(RankFailed, rank))
    try:
        torch.set_num_threads(threads)
        _quiet_progress_bars()
        deploy = DeployConfig.model_validate_json(deploy_json)
        mesh = join_pool(deploy, rank, port)
        _, pipeline = build_rank_pipeline(model, deploy, mesh)
        engine = FollowerEngine(pipeline, deploy, rank)
        conn.send(RankReady(rank))
    except BaseException:
        die(pipe)
    serve_messages(pipe, lambda msg: engine.run(msg) if isinstance(msg, PlanMessage) else engine.answer(msg))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _quiet_progress_bars() -> None:
    """Rank 0 shows the loading bars; N copies of them are noise (and each bar's lock is a
    semaphore a rank that exits with ``os._exit`` would leave registered)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _warm_imports() -> None:
    """What every rank's load touches first: the families, transformers' model and tokenizer
    machinery (its lazy module structure takes seconds to build; a fork inherits it built)."""
    discover_families()
    import transformers

    transformers.PreTrainedModel, transformers.AutoTokenizer  # noqa: B018  (resolve the lazy attributes)


_warm_imports()
