"""The SPMD worker pool: one process per rank; rank 0 is this process and runs the engine.

Rank 0's ``StepScheduler`` decides every iteration; :class:`PoolEngine` sends the frozen
``SchedulerPlan`` (with the requests it admits) to ranks 1..N-1 over one pipe each, runs
the plan's work itself, and collects one :class:`RankOutcome` per rank. The collectives
inside the work (sequence / tensor / row parallel) run on the pool's process group (gloo
on CPU, NCCL on GPUs); the control channel is the pipes, so an idle pool waits without a
timeout and a rank that dies is seen at once (its pipe and process sentinel close — the
worker-death watch of Dreamverse's ``gpu_pool.py``).

Failures (design §6.3.1):

* request-fatal — a step that raises on some rank fails that request; rank 0 ends it and
  tells the other ranks with the next plan (``PlanMessage.failed``), so every rank drops it;
* pool-fatal — a rank that died, a collective that failed or timed out, or (debug) ranks
  whose plan hashes disagree: ``PoolFatalError``; the engine restarts the pool (new
  processes, a new process group, the pipeline reloaded) and re-queues or fails the
  in-flight requests (``DeployConfig.on_pool_failure``, ``max_pool_restarts``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omniloop.deploy import DeployConfig
from omniloop.engine.engine import Engine, EngineConfig, EventSink
from omniloop.engine.errors import PoolFatalError
from omniloop.engine.pool_messages import PlanMessage, Query, RankFailed, RankOutcome, RankReady, plan_digest
from omniloop.engine.pool_worker import build_rank_pipeline, is_collective_error, join_pool, worker_main
from omniloop.engine.request import EngineRequest
from omniloop.engine.scheduler import SchedulerPlan
from omniloop.models.model_spec import ModelSpec
from omniloop.parallel.launch import process_context, rank_threads
from omniloop.parallel.mesh import rendezvous_store
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import ErrorKind, Failure, RequestStatus

logger = logging.getLogger(__name__)

class SPMDPool:
    """Ranks 1..N-1 as child processes, rank 0 in this process."""

    def __init__(self, model: str | Path, deploy: DeployConfig, *, preload: tuple[str, ...] = ()) -> None:
        self.model = str(model)
        self.deploy = deploy
        self.preload = preload
        self.spec = deploy.parallel
        self.mesh: Any = None
        self._store: Any = None  # the rendezvous TCPStore (rank 0 holds it)
        self._threads_before: int | None = None  # this process's thread count before the pool
        self.threads: int | None = None  # every rank's intra-op threads (CPU pools), once started
        self._procs: list[Any] = []  # rank r at index r - 1
        self._conns: list[Any] = []
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> tuple[ModelSpec, Pipeline]:
        """Start the other ranks, join the process group, build rank 0's pipeline, and wait
        until every rank has built its own."""
        ctx = process_context(self.deploy.torch_device(), self.preload)
        self._store = rendezvous_store(self.spec.timeout_s)  # held by rank 0 while the pool lives
        port = self._store.port
        deploy_json = self.deploy.model_dump_json()
        threads = rank_threads(self.spec.world, self.deploy.torch_device())
        if self._threads_before is None:
            self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # rank 0 is one of the ranks sharing the cores
        self.threads = threads if self.deploy.torch_device().type == "cpu" else None
        for rank in range(1, self.spec.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, self.model, deploy_json, port, threads, child),
                               name=f"omniloop-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.starts += 1
        try:
            self.mesh = self._join(port)
            model_spec, pipeline = build_rank_pipeline(self.model, self.deploy, self.mesh)
            for rank in range(1, self.spec.world):
                self._receive(rank, RankReady, "start")
        except BaseException:
            self.shutdown()
            raise
        logger.info("pool of %d ranks up (%s), start %d", self.spec.world, self.spec.compact(), self.starts)
        return model_spec, pipeline

    def _join(self, port: int) -> Any:
        """Rank 0's rendezvous, watching the other ranks meanwhile: one that fails before it
        joins would otherwise leave rank 0 waiting for the whole timeout."""
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["mesh"] = join_pool(self.deploy, 0, port, store=self._store)
            except BaseException as e:  # surfaced below
                result["error"] = e

        thread = threading.Thread(target=join, name="omniloop-rank0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.05)
            for rank, conn in enumerate(self._conns, start=1):
                proc = self._procs[rank - 1]
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        proc.join(timeout=5)
                        msg = None
                    if isinstance(msg, RankFailed):
                        raise RuntimeError(f"rank {rank} failed to start:\n{msg.error}")
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"rank {rank} exited with code {proc.exitcode} while starting (a script that starts a "
                        "pool must guard its entry point with `if __name__ == '__main__':`, as multiprocessing "
                        "re-imports the main module in every rank)")
        if "error" in result:
            raise result["error"]
        return result["mesh"]

    def restart(self) -> Pipeline:
        """The engine's ``restart_pool``: every rank anew (state, caches and collectives).
        The old ranks are killed, not asked to stop: after a pool-fatal error one may be hung
        in a collective that will never complete (it would not read the stop message)."""
        self._stop_ranks(kill=True)
        return self.start()[1]

    def shutdown(self) -> None:
        """Stop the other ranks, leave the process group, restore this process's threads."""
        self._stop_ranks()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _stop_ranks(self, kill: bool = False) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if kill and proc.exitcode is None:
                proc.kill()
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        self.mesh, self._store = None, None

    # -- the channel -----------------------------------------------------------------------
    def dead_ranks(self) -> list[int]:
        return [rank for rank, proc in enumerate(self._procs, start=1) if proc.exitcode is not None]

    def publish(self, message: PlanMessage | Query) -> None:
        """Send ``message`` to every other rank."""
        for rank in range(1, self.spec.world):
            self.send(rank, message)

    def send(self, rank: int, message: Any) -> None:
        self._check_alive()
        try:
            self._conns[rank - 1].send(message)
        except OSError as e:
            raise PoolFatalError(f"rank {rank} is unreachable: {e}") from e

    def collect(self, what: str) -> list[Any]:
        """One answer from each other rank, in rank order."""
        return [self._receive(rank, object, what) for rank in range(1, self.spec.world)]

    def _receive(self, rank: int, kind: type, what: str) -> Any:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        ready = wait([conn, proc.sentinel], timeout=self.spec.timeout_s)
        if conn in ready:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, RankFailed):
                raise PoolFatalError(f"rank {rank} failed during {what}: {msg.error.strip().splitlines()[-1]}")
            if msg is not None and isinstance(msg, kind):  # None: the pipe closed (a rank that died)
                return msg
            if msg is not None:
                raise PoolFatalError(f"rank {rank} answered {type(msg).__name__} to {what}")
        if proc.exitcode is not None or proc.sentinel in ready:
            proc.join(timeout=1)
            raise PoolFatalError(f"rank {rank} died (exit code {proc.exitcode}) during {what}")
        raise PoolFatalError(f"rank {rank} did not finish {what} within {self.spec.timeout_s:g} s")

    def _check_alive(self) -> None:
        dead = self.dead_ranks()
        if dead:
            codes = {r: self._procs[r - 1].exitcode for r in dead}
            raise PoolFatalError(f"ranks {dead} died (exit codes {codes})")

    def query(self, name: str) -> list[Any]:
        self.publish(Query(name))
        return self.collect(f"query {name!r}")


class PoolEngine(Engine):
    """The engine on rank 0 of an SPMD pool (see the module docstring)."""

    def __init__(self, pool: SPMDPool, model_spec: ModelSpec, pipeline: Pipeline, config: EngineConfig,
                 *, event_sink: EventSink | None = None) -> None:
        super().__init__(pipeline, config, event_sink=event_sink, restart_pool=pool.restart)
        self.pool = pool
        self.model_spec = model_spec
        self._tell_failed: list[tuple[str, Failure]] = []  # request-fatal on rank 0, sent with the next plan
        self._ended: list[tuple[str, str, Failure | None]] | None = None
        self._finalizer = weakref.finalize(self, pool.shutdown)

    def send(self, request_id: str, item: Any) -> None:
        """Refused: a live input would reach rank 0's loop only (plans carry no session inputs),
        and the other ranks' copies of the request would diverge from it."""
        raise ValueError(f"live inputs to a running request ({type(item).__name__} for {request_id!r}) are not "
                         f"sent to the other ranks of an SPMD pool (parallel='{self.pool.spec.compact()}'); "
                         "serve interactive sessions from a one-rank deployment (parallel='dp=1')")

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        self._finalizer()

    def rank_plugin_metrics(self) -> list[dict[str, Any]]:
        """Every rank's plugin metrics, rank 0 first (cache decisions must agree within an sp group)."""
        return [self.plugin_metrics(), *self.pool.query("plugin_metrics")]

    # -- one iteration ---------------------------------------------------------------------
    def _run_plan(self, plan: SchedulerPlan) -> None:
        if plan.empty and not self._tell_failed:
            return
        requests = tuple(self.scheduler.running[rid].request for rid in plan.admitted)
        message = PlanMessage(plan, requests, tuple(self._tell_failed), self.pool.spec.check_plans)
        self._tell_failed = []
        digest = plan_digest(plan, self.scheduler) if message.check else None
        self.pool.publish(message)
        self._ended = []
        try:
            super()._run_plan(plan)
            ended = self._ended
        finally:
            self._ended = None
        outcomes = self.pool.collect(f"plan {plan.iteration}")
        self._reconcile(plan, digest, ended, outcomes)

    def _reconcile(self, plan: SchedulerPlan, digest: str | None, ended: list, outcomes: list[RankOutcome]) -> None:
        if digest is not None:
            wrong = {o.rank: o.plan_hash for o in outcomes if o.plan_hash != digest}
            if wrong:
                raise PoolFatalError(f"plan {plan.iteration}: ranks {sorted(wrong)} hashed it {wrong}, rank 0 "
                                     f"{digest}: the ranks' request states diverged")
        # a FAILED ending always carries its failure (Engine._finish's callers give one)
        self._tell_failed += [(rid, failure) for rid, status, failure in ended
                              if status == RequestStatus.FAILED.value and failure is not None]
        for outcome in outcomes:
            for rid, status, failure in outcome.ended:
                req = self.scheduler.find(rid)
                if status == RequestStatus.FAILED.value and failure is not None and req is not None:
                    on_rank = failure.prefixed(f"rank {outcome.rank}: ")
                    self._finish(req, RequestStatus.FAILED, on_rank)
                    self._tell_failed.append((rid, on_rank))

    # -- failures --------------------------------------------------------------------------
    def _finish(self, req: EngineRequest, status: RequestStatus, failure: Failure | None) -> None:
        if self._ended is not None and not req.is_finished:
            self._ended.append((req.request_id, status.value, failure))
        super()._finish(req, status, failure)

    def _fail(self, req: EngineRequest, exc: BaseException) -> None:
        dead = self.pool.dead_ranks()
        if dead or is_collective_error(exc):  # not this request's fault: every rank's state is suspect
            raise PoolFatalError(f"while running {req.request_id}: {exc}" + (f" (ranks {dead} died)" if dead else "")) from exc
        super()._fail(req, exc)

    def _on_pool_failure(self, error: PoolFatalError) -> None:
        self._tell_failed = []  # the new ranks hold no state to drop
        try:
            super()._on_pool_failure(error)
        except Exception as exc:  # the restart itself failed (a rank could not start again)
            logger.exception("pool restart failed")
            self.dead = f"pool restart failed: {exc}; after: {error}"
            for req in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                self._finish(req, RequestStatus.FAILED,
                             Failure(kind=ErrorKind.ENGINE_DEAD, message=f"engine dead: {self.dead}"))
        finally:
            if self.dead:
                self.close()


def launch_pool_engine(model: str | Path, deploy: DeployConfig, *, event_sink: EventSink | None = None) -> PoolEngine:
    """Check the spec against the checkpoint (before any weight is read), start the pool,
    and return rank 0's engine."""
    facts = model_facts(model)
    check_model(deploy.parallel, facts)
    pool = SPMDPool(model, deploy, preload=facts.plan.preload if facts.plan is not None else ())
    model_spec, pipeline = pool.start()
    return PoolEngine(pool, model_spec, pipeline, EngineConfig.from_deploy(deploy), event_sink=event_sink)


__all__ = ["PoolEngine", "SPMDPool", "launch_pool_engine"]
