"""``ServeState``: what every route shares — the engine, the job store and runner, the
metrics, and the server's lifecycle (warming up -> ready -> draining)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from starlette.requests import HTTPConnection

from omniloop.engine import AsyncEngine, EngineError, RequestRejected
from omniloop.pipeline.defaults import resolve_seeds
from omniloop.request import ErrorKind, Failure, OmniRequest, RequestStatus
from omniloop.serve.browser import TOKEN_COOKIE, BrowserTokens
from omniloop.serve.config import ServeConfig
from omniloop.serve.errors import ApiError, api_error
from omniloop.serve.jobs import Job, JobKind, JobStore
from omniloop.serve.metrics import ServeMetrics
from omniloop.serve.runner import JobRunner
from omniloop.serve.warmup import WarmupFailed, run_warmup, warmup_shapes
from omniloop.serve.wire import ServedModel, WireError

logger = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ServeState:
    def __init__(self, engine: AsyncEngine, config: ServeConfig, jobs: JobStore | None = None) -> None:
        self.engine, self.config = engine, config
        self.models = ServedModel.all_of(engine, config.served_model_name)  # by name, the default first
        self.model = next(iter(self.models.values()))  # the default: what a request without "model" gets
        self.limits = self.model.limits  # the engine's (DeployConfig.limits), enforced at its admission
        self.jobs = jobs if jobs is not None else JobStore.open(config)
        self.metrics = ServeMetrics(engine.stats, self._cache_summaries)
        self.runner = JobRunner(engine, self.jobs, self.metrics)
        self.warmup_shapes = warmup_shapes(config.warmup, self.model.defaults, self.limits, self.model.tasks)
        self.warmed = False
        self.warmup_error: str | None = None
        self.on_fatal: Callable[[Exception], None] | None = None  # a failed warmup; the server stops
        self.on_ready: Callable[[], None] | None = None
        self.draining = False
        self.browser_tokens = BrowserTokens(config.browser_token_s)  # cookies standing in for the key (/play)
        self.lora_upload_dir: Path | None = None  # LoRA files uploaded through /v1/loras (serve/loras.py)
        plane = engine.weight_plane()
        if plane is not None:
            plane.while_asleep = config.while_asleep  # requests arriving while asleep (serve/weights.py)
        self.on_close: list[Callable[[], None]] = []
        self.started_at = int(time.time())
        self._tasks: list[asyncio.Task] = []

    def served(self, requested: str | None) -> ServedModel:
        """The model a request's ``model`` field names (None: the default); 404 naming the
        served ones otherwise."""
        if requested is None:
            return self.model
        for model in self.models.values():
            if requested == model.name or requested in model.aliases:
                return model
        raise WireError("model", f"{requested!r} is not served here; pass one of {sorted(self.models)} "
                        "(see /v1/models)", status=404, code="model_not_found")

    def _cache_summaries(self) -> dict[str, dict[str, dict]]:
        """The engine's cache counters by served model name."""
        summaries = self.engine.cache_summaries()
        if self.model.route is None:  # one model: the engine knows it by its checkpoint path
            return {self.model.name: next(iter(summaries.values()), {})}
        return summaries

    # -- lifecycle ------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        if not self.engine.stats()["alive"]:
            return False, "engine stopped"
        if self.draining:
            return False, "draining"
        if self.warmup_error is not None:
            return False, f"warmup failed: {self.warmup_error}"
        if not self.warmed:
            return False, "warming up"
        return True, "ready"

    def start(self) -> None:
        self._attach_checkpoints()
        self._tasks.append(asyncio.create_task(self._warmup(), name="omniloop-warmup"))
        if self.jobs.max_age_s is not None:
            self._tasks.append(asyncio.create_task(self._sweep_by_age(), name="omniloop-retention"))

    async def _warmup(self) -> None:
        try:
            await run_warmup(self.engine, self.warmup_shapes, self.model.tasks, self.model.defaults,
                             mask=self.model.takes_mask, control=self.model.takes_control)
        except WarmupFailed as e:
            self.warmup_error = str(e)
            logger.error("%s", e)
            if self.on_fatal is not None:  # the process exits non-zero (server.py)
                self.on_fatal(e)
            return
        self.warmed = True
        await self._requeue()
        if self.on_ready is not None:
            self.on_ready()

    async def _requeue(self) -> None:
        """Jobs a dead process left queued or running, submitted again (``requeue_on_restart``):
        each resumes from its crash checkpoint when it has one (the engine restores it at the
        loop's init). One that cannot run here (its model is not served now, the limits
        refuse it) is failed saying why."""
        pending, self.jobs.pending = self.jobs.pending, []
        for job, request in pending:
            if not self._serves(job.model):
                self._refuse_requeued(job, Failure(
                    kind=ErrorKind.INTERRUPTED, message=f"it ran on model {job.model!r}, which this server does not "
                    f"serve now (it serves {sorted(self.models)}); submit it again"))
                continue
            job.progress = 0  # counted again: from the step it resumes from (its ProgressEvent), else from 0
            try:
                await self.runner.start(job, request, stored=True)
            except EngineError as e:  # e.g. the limits changed across the restart
                refused = e.failure() if isinstance(e, RequestRejected) else \
                    Failure(kind=ErrorKind.ENGINE_DEAD, message=str(e))
                self._refuse_requeued(job, refused)

    def _serves(self, model: str) -> bool:
        return any(model == m.name or model in m.aliases for m in self.models.values())

    def _refuse_requeued(self, job: Job, failure: Failure) -> None:
        job.status = RequestStatus.FAILED
        job.failure = failure.prefixed("re-queued after a restart, then refused: ")
        job.completed_at = int(time.time())
        job.seal()
        self.jobs.save(job)
        if self.jobs.checkpoints is not None:
            self.jobs.checkpoints.discard(job.id)

    def _attach_checkpoints(self) -> None:
        """Running jobs' loops checkpoint into the durable store's ``JobCheckpoints`` (and resumed
        ones restore from it); the step a job resumed from is recorded on it."""
        store = self.jobs.checkpoints
        if store is None:
            return
        from omniloop.engine.pool import PoolEngine

        if isinstance(self.engine.engine, PoolEngine):  # its ranks would each have to restore: not yet
            logger.warning("an SPMD pool writes no crash checkpoints: re-queued jobs run from their first step")
            return
        loop = asyncio.get_running_loop()

        def on_resumed(job_id: str, node: str, step: int | None, why: str | None) -> None:
            loop.call_soon_threadsafe(self._resumed, job_id, step)  # the job is the event loop's

        store.on_resumed = on_resumed
        store.is_job = lambda rid: self.jobs.get(rid) is not None  # a dict read, from the engine thread
        self.engine.engine.checkpoints = store

    def _resumed(self, job_id: str, step: int | None) -> None:
        job = self.jobs.get(job_id)
        if job is not None and step is not None:
            job.resumed_from_step = step
            self.jobs.save(job)

    async def _sweep_by_age(self) -> None:
        """Age retention between completions (each completion sweeps too)."""
        assert self.jobs.max_age_s is not None
        while True:
            await asyncio.sleep(min(60.0, self.jobs.max_age_s / 4))
            self.jobs.sweep()

    async def drain(self) -> None:
        """No new admissions; in-flight jobs finish (cancelled after drain_timeout_s) or are
        cancelled now, per ``config.drain``; returns once every job is sealed."""
        if self.draining:
            return
        self.draining = True
        timeout = 0.0 if self.config.drain == "cancel" else self.config.drain_timeout_s
        logger.info("draining (%s, timeout %.1fs): %d job(s) in flight", self.config.drain, timeout,
                    len(self.jobs.unfinished()))
        await self.engine.drain(timeout=timeout)
        await self.runner.wait_idle()
        logger.info("drained")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.runner.shutdown()
        self.jobs.close()
        for cleanup in self.on_close:
            cleanup()

    # -- admission ------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "server is draining and accepts no new requests", code="draining",
                           headers={"Retry-After": "5"})

    async def submit(self, jobs: list[Job], requests: list[OmniRequest], names: Mapping[str, str]) -> None:
        """Start every job or none: a rejection cancels the ones already submitted. ``names``:
        the wire name of each request field (a WireCall's), for the rejection's ``param``."""
        if not self.jobs.room_for(len(jobs)):
            raise ApiError(429, f"job store is full ({self.config.max_jobs} unfinished jobs); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        started: list[Job] = []
        try:
            for job, request in zip(jobs, requests, strict=True):
                if self.config.requeue_on_restart:  # the stored request draws the same noise when it runs again
                    request = resolve_seeds(request, self.served(request.model).defaults)
                await self.runner.start(job, request)
                started.append(job)
        except EngineError as e:
            for job in started:
                await self.runner.cancel(job, self.config.cancel_wait_s)
                self.jobs.remove(job.id)
            raise api_error(e, names) from None

    @contextlib.contextmanager
    def counting_rejections(self, kind: str) -> Iterator[None]:
        """Count every refusal of a create call in the rejected metric, by HTTP status."""
        try:
            yield
        except (ApiError, WireError, RequestRejected) as e:
            error = api_error(e)
            self.metrics.rejected.labels(kind, str(error.status)).inc()
            raise error from None

    def job(self, job_id: str, kind: JobKind) -> Job:
        job = self.jobs.get(job_id)
        if job is None or job.kind is not kind:
            raise ApiError(404, f"no {kind.value} {job_id!r}; it never existed, was deleted, or was evicted",
                           param="id", code="not_found")
        return job


def get_state(conn: HTTPConnection) -> ServeState:
    return conn.app.state.omniloop


State = Annotated[ServeState, Depends(get_state)]  # a route's ``state: State`` parameter


def require_auth(request: Request) -> None:
    check_auth(request)


def check_auth(conn: HTTPConnection) -> None:
    """The API key as ``Authorization: Bearer <key>`` (the scheme is case-insensitive, as HTTP
    says), or a browser token's cookie issued for it (``POST /v1/browser-token``)."""
    state = get_state(conn)
    key = state.config.api_key
    if key is None:
        return
    scheme, _, given = conn.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key.encode()):
        return
    if not state.browser_tokens.valid(conn.cookies.get(TOKEN_COOKIE)):
        raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
