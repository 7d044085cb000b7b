"""``AsyncEngine``: the engine on a background thread, with an asyncio front.

The worker thread owns ``Engine.step()``; callers on the event loop add and abort
requests (validated synchronously, so bad input raises at the call) and receive events
through per-request asyncio queues fed thread-safely from the worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, AsyncGenerator

import torch

from omniloop.deploy import DeployConfig
from omniloop.cache.adapters import CACHE_NAME as ADAPTERS
from omniloop.cache.text_embeddings import CACHE_NAME as TEXT_EMBEDDINGS
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.engine_like import EngineLike
from omniloop.engine.model_pool import ModelPool
from omniloop.engine.errors import EngineDeadError, RequestRejected, UnknownRequest
from omniloop.engine.weights import (DEFAULT_ROLE, Running, SleepReport, WeightInfo, WeightPlane, WeightSource,
                                     WeightUpdateRefused)
from omniloop.ext.install import install_plugins
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import ErrorKind, Failure, FinalEvent, OmniEvent, OmniOutput, OmniRequest, RequestStatus

logger = logging.getLogger(__name__)

_REPORTED_CACHES = (TEXT_EMBEDDINGS, ADAPTERS)  # caches with summary() counters for /metrics


def _server_cpu_threads(config: DeployConfig) -> int | None:
    """The engine thread's intra-op thread count, or None to keep torch's."""
    if config.torch_device().type == "cpu" and config.cpu_threads != "auto":
        # an explicit count (serve --cpu-threads N) holds; "auto" keeps torch's for a long-lived server,
        # whose load is its own work, not a neighbour's
        from omniloop.cpu_threads import apply_cpu_threads

        return apply_cpu_threads(config.cpu_threads)
    return None


def load_options(deploy: DeployConfig) -> LoadOptions:
    """The slice of ``deploy`` that loading and pipeline building read (its device checked first).
    Kernel options left "auto" hold the CPU's values and are named in ``auto``: the loader sets
    them from the family's fast path once it knows the family (models/fast_path.py)."""
    deploy.check_device()
    auto = {name for name in ("attention_backend", "cfg_mode", "compile") if getattr(deploy, name) == "auto"}
    if deploy.parallel.world > 1:  # the SPMD axes have their own kernel rules (parallel/preflight.py)
        auto.discard("attention_backend")
        auto.discard("cfg_mode")
    return LoadOptions(device=deploy.torch_device(), dtype=deploy.torch_dtype(),
                       attention_backend="sdpa" if deploy.attention_backend == "auto" else deploy.attention_backend,
                       cfg_mode="sequential" if deploy.cfg_mode == "auto" else deploy.cfg_mode,
                       compile=deploy.compile is True, compile_cache_dir=deploy.compile_cache_dir,
                       compile_dynamic=deploy.compile_dynamic, auto=frozenset(auto), quantization=deploy.quantization,
                       text_cache_bytes=int(deploy.text_cache_mb * 2**20), resolution_buckets=deploy.bucket_sizes(),
                       lora_device_bytes=int(deploy.lora_device_mb * 2**20),
                       lora_host_bytes=int(deploy.lora_host_mb * 2**20), loras=tuple(deploy.lora_files.items()),
                       chunk_kv_budget_bytes=None if deploy.chunk_kv_budget_gb is None
                       else int(deploy.chunk_kv_budget_gb * 2**30),
                       kv_cache_gb=deploy.kv_cache_gb, cuda_graphs=deploy.cuda_graphs,
                       max_audio_tokens=deploy.max_audio_tokens,
                       cuda_graph_max_tokens=deploy.cuda_graph_max_tokens,
                       cuda_graph_max_graphs=deploy.cuda_graph_max_graphs)


def _with_plugins(pipeline: Pipeline, config: DeployConfig) -> Pipeline:
    return install_plugins(pipeline, config.plugins, compile=pipeline.compiled)


class AsyncEngine:
    def __init__(self, engine: EngineLike, *, model_name: str = "", threads: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        # torch's intra-op count is per thread once a thread has computed (OpenMP's ICV): the
        # engine thread sets its own, so another engine or caller setting theirs later (a session
        # model's cpu_threads=auto) cannot change how this one's CPU kernels round
        self._threads = threads
        # request id -> (its caller's event loop, the queue its events go to); one entry per
        # live stream, removed when the stream ends (however it ends)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._queues_lock = threading.Lock()  # the worker thread reads it while callers write it
        self._wake = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        engine.event_sink = self._on_event
        self._thread = threading.Thread(target=self._run, name="omniloop-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str | Path, *, deploy: DeployConfig | None = None, **options: Any) -> "AsyncEngine":
        """Load like ``VideoGenerator.from_pretrained``; ``options`` are DeployConfig fields
        (``plugins={name: config}`` enables plugins, e.g. from the server's deploy config file)."""
        config = DeployConfig.from_options(deploy, **options)
        threads = _server_cpu_threads(config)
        if config.parallel.world > 1:  # this process becomes rank 0 of an SPMD pool (engine/pool.py)
            from omniloop.engine.pool import launch_pool_engine

            pool_engine = launch_pool_engine(model, config)
            return cls(pool_engine, model_name=str(model), threads=pool_engine.pool.threads)
        if config.placement:  # nodes on role pools, each a worker process (engine/role_pool.py)
            from omniloop.engine.role_pool import launch_role_engine

            return cls(launch_role_engine(model, config), model_name=str(model), threads=threads)
        opts = load_options(config)

        def build() -> Pipeline:  # DeployConfig.plugins is the one source of enabled plugins
            pipeline = load_pipeline(model, opts)[1]
            return install_plugins(pipeline, config.plugins, compile=pipeline.compiled)

        engine = Engine(build(), EngineConfig.from_deploy(config), restart_pool=build)
        return cls(engine, model_name=str(model), threads=threads)

    @classmethod
    def serving_models(cls, models: Mapping[str, str | Path], *, deploy: DeployConfig | None = None,
                       **options: Any) -> "AsyncEngine":
        """Several models on one engine loop (``ModelPool``): ``models`` maps the name clients
        pass as ``model`` to a checkpoint; the first is the default. Weights share the device
        under ``model_device_gb`` / ``model_host_gb``."""
        if not models:
            raise ValueError("models: pass at least one {name: checkpoint}")
        config = DeployConfig.from_options(deploy, **options)
        threads = _server_cpu_threads(config)
        if config.parallel.world > 1:
            raise ValueError("parallel: a server of several models runs on one device; serve one model per SPMD pool")
        if config.placement:
            raise ValueError("placement: a server of several models runs on one device; serve one model per "
                             "deployment with role pools")
        opts = load_options(config)

        def builder(path: str | Path) -> Callable[[], Pipeline]:
            return lambda: _with_plugins(load_pipeline(path, opts)[1], config)

        gib = 2**30
        pool = ModelPool({n: builder(p) for n, p in models.items()}, EngineConfig.from_deploy(config),
                         device_budget_bytes=None if config.model_device_gb is None else int(config.model_device_gb * gib),
                         host_budget_bytes=None if config.model_host_gb is None else int(config.model_host_gb * gib),
                         sources={n: (str(p),) for n, p in models.items()}, load_options=opts,
                         prepare=lambda pipeline: _with_plugins(pipeline, config))
        return cls(pool, model_name=next(iter(models)), threads=threads)

    def cache_summaries(self) -> dict[str, dict[str, dict[str, Any]]]:
        """model -> cache name -> counters (the text-embedding and adapter caches) of every
        loaded pipeline: what ``/metrics`` shows."""
        e = self.engine
        pipelines = e.loaded_pipelines() if isinstance(e, ModelPool) else {self.model_name: e.pipeline}
        return {model: {name: cache.summary() for name, cache in p.caches.items() if name in _REPORTED_CACHES}
                for model, p in pipelines.items()}

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        with torch.inference_mode():
            while not self._stop:
                with self._wake:
                    while not self._stop and not self.engine.has_unfinished():
                        self._wake.wait(timeout=0.5)
                    idle = self.engine.idle_s()
                    if idle:  # every running request waits (a paced session): sleep until one is due
                        self._wake.wait(timeout=min(idle, 0.1))
                if self._stop:
                    break
                try:
                    self.engine.step()
                except EngineDeadError as e:
                    self._error = e
                    logger.error("engine dead: %s", e)
                    break
                except Exception as e:  # a bug in the engine itself: stop, fail everything
                    logger.exception("engine loop crashed")
                    self._error = e
                    break
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._queues_lock:
            pending = list(self._queues.items())
        for rid, (loop, queue) in pending:
            out = OmniOutput(request_id=rid, status=RequestStatus.FAILED,
                             failure=Failure(kind=ErrorKind.ENGINE_DEAD, message=f"engine stopped: {self._error}"))
            loop.call_soon_threadsafe(queue.put_nowait, FinalEvent(request_id=rid, output=out))

    def _on_event(self, event: OmniEvent) -> None:
        with self._queues_lock:
            target = self._queues.get(event.request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- public API ---------------------------------------------------------------------
    def submit(self, request: OmniRequest, *, paused: bool = False) -> asyncio.Queue:
        """Queue ``request`` (raises RequestRejected on bad input / full queue) and return
        the asyncio queue its events arrive on. ``paused``: see ``Engine.add_request``."""
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error}")
        queue: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        entry = (asyncio.get_running_loop(), queue)
        with self._queues_lock:  # the queue must exist before add_request emits the first event
            if rid in self._queues:  # a live stream holds this id: leave it untouched
                self.engine.stats.rejected += 1
                raise RequestRejected(f"request_id {rid!r} is already in use", hint="pass a new id (or omit it)",
                                      fields=("request_id",), kind=ErrorKind.DUPLICATE)
            self._queues[rid] = entry
        try:
            self.engine.add_request(request, paused=paused)
        except BaseException:
            self._drop_queue(rid, entry)
            raise
        self._notify()
        return queue

    def _drop_queue(self, request_id: str, entry: tuple[asyncio.AbstractEventLoop, asyncio.Queue]) -> None:
        """Remove ``request_id``'s queue if it is still ``entry`` (never another stream's)."""
        with self._queues_lock:
            if self._queues.get(request_id) is entry:
                del self._queues[request_id]

    async def stream(self, request: OmniRequest, *, paused: bool = False) -> AsyncGenerator[OmniEvent, None]:
        """Events of ``request`` until (and including) its FinalEvent. Closing the stream
        early (``aclose()``, a cancelled task: a client disconnect) aborts the request and
        frees everything held for it. ``paused``: queued but held until ``resume``."""
        queue = self.submit(request, paused=paused)
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            self._release(request.request_id, queue)

    async def generate(self, request: OmniRequest) -> OmniOutput:
        async for event in self.stream(request):
            if isinstance(event, FinalEvent):
                return event.output
        raise AssertionError("stream ended without a final event")

    def _release(self, request_id: str, queue: asyncio.Queue) -> None:
        with self._queues_lock:
            entry = self._queues.get(request_id)
        if entry is not None and entry[1] is queue:
            self._drop_queue(request_id, entry)
        if self.engine.pop_output(request_id) is not None or not self.engine.is_tracked(request_id):
            return
        try:  # the caller went away before the end (e.g. a client disconnect)
            self.engine.abort(request_id, forget=True)
        except UnknownRequest:  # it ended and was popped in between
            return
        self._notify()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._notify()

    async def send(self, request_id: str, item: Any) -> None:
        """A live input for a running request (``Engine.send``)."""
        self.engine.send(request_id, item)
        self._notify()

    async def pause(self, request_id: str) -> None:
        """Hold a request's steps (``Engine.pause``): its state stays, nothing runs."""
        self.engine.pause(request_id)

    async def resume(self, request_id: str) -> None:
        """Run a paused request's steps again."""
        self.engine.resume(request_id)
        self._notify()

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting requests; wait for in-flight ones, cancelling them after ``timeout``."""
        self.engine.accepting = False
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while self.engine.has_unfinished() and self._error is None:
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                reason = (f"cancelled by the drain timeout: still running {timeout:g} s after the drain began "
                          "(drain_timeout_s)") if timeout else "cancelled by the drain: in-flight work is cancelled " \
                                                             "at shutdown (drain: cancel)"
                for rid in self.engine.tracked_ids():
                    try:
                        self.engine.abort(rid, reason=reason)
                    except UnknownRequest:  # popped meanwhile
                        pass
                self._notify()
                deadline = None
            await asyncio.sleep(0.01)

    # -- the weight plane (engine/weights.py) -----------------------------------------------------
    def weight_plane(self) -> WeightPlane | None:
        """The engine's weight plane; None for a pool of several models or an SPMD pool (a swap
        on rank 0 alone would split the ranks' weights)."""
        from omniloop.engine.pool import PoolEngine

        e = self.engine
        return e.weights if isinstance(e, Engine) and not isinstance(e, PoolEngine) else None

    def _plane(self) -> WeightPlane:
        plane = self.weight_plane()
        if plane is None:
            raise WeightUpdateRefused("model: this deployment (several models, or an SPMD pool) takes no weight "
                                      "updates or sleep; serve one model on one device", field="model")
        return plane

    async def update_weights(self, source: WeightSource, version: str | int, *, role: str = DEFAULT_ROLE,
                             component: str = "transformer", running: Running = "finish") -> WeightInfo:
        """``Engine.update_weights`` from the event loop: checked here (a file is read off the
        loop), applied by the engine thread at a step boundary; returns once swapped."""
        plane = self._plane()
        future = await asyncio.to_thread(plane.schedule_update, source, version, role=role, component=component,
                                         running=running)
        self._notify()
        return await asyncio.wrap_future(future)

    async def sleep(self, level: int = 1, *, running: Running = "finish") -> SleepReport:
        future = self._plane().schedule_sleep(level, running=running)
        self._notify()
        return await asyncio.wrap_future(future)

    async def wake(self) -> SleepReport:
        future = self._plane().schedule_wake()
        self._notify()
        return await asyncio.wrap_future(future)

    def stats(self) -> dict[str, Any]:
        e = self.engine
        plane = self.weight_plane()
        return {
            "model": self.model_name,
            "waiting": e.num_waiting(),
            "running": e.num_running(),
            "backlog_s": e.predicted_backlog_s(),  # predicted seconds of work left (the cost model's)
            "completed": e.stats.completed,
            "failed": e.stats.failed,
            "cancelled": e.stats.cancelled,
            "rejected": e.stats.rejected,
            "pool_restarts": e.stats.pool_restarts,
            "steps": e.stats.steps,
            "batched_steps": e.stats.batched_steps,
            "accepting": e.accepting,
            "tracked": len(e.tracked_ids()),  # requests known by id (queued, running, output not popped)
            "streams": len(self._queues),
            "alive": self._error is None and self._thread.is_alive(),
            "cost_model": e.cost_model.snapshot(),
            "plugins": e.plugin_metrics(),
            # the weight plane: the served version (None: a deployment without one), updates, sleep level
            "weight_version": None if plane is None else plane.version,
            "weight_role": None if plane is None else plane.info.role,
            "weight_updates": 0 if plane is None else plane.updates,
            "asleep": 0 if plane is None else plane.asleep,
        }

    def shutdown(self) -> None:
        self._stop = True
        self._notify()
        self._thread.join(timeout=10)
        close = getattr(self.engine, "close", None)  # an SPMD pool's other ranks
        if close is not None:
            close()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.shutdown()
