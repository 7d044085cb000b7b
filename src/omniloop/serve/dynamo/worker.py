"""``omniloop dynamo-worker``: one ``AsyncEngine`` served as a Dynamo backend.

Lifecycle (design §6.3.5, contract item 1):

1. create the ``DistributedRuntime`` (its status server answers ``/health`` = notready);
2. load the model and run the warmup (``serve/warmup.py``: compiles, allocates, calibrates
   the cost model; a failure exits non-zero naming the shape and the cause) — a SIGTERM
   meanwhile exits cleanly without ever registering;
3. register ``ModelType.Videos`` on ``<namespace>.<component>.videos`` (and
   ``ModelType.Images`` on ``...images`` for image-capable models), with the roles it serves
   in the runtime config (``roles.py``), and serve: the worker is ready only now;
4. on SIGTERM/SIGINT (Dynamo's handlers): leave discovery, keep serving through the
   router grace period (``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``), drain the engine
   (finish in-flight requests, cancel the rest after ``drain_timeout_s``), stop the
   engine thread, shut the runtime down; exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvloop
from dynamo.common.utils.graceful_shutdown import install_signal_handlers
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

from omniloop.deploy import DeployConfig
from omniloop.engine import AsyncEngine
from omniloop.request import DiffusionParams
from omniloop.serve.config import DEFAULT_DRAIN_TIMEOUT_S
from omniloop.serve.dynamo.handler import HEALTH_CHECK_KEY, GenerationHandler
from omniloop.serve.dynamo.metrics import WorkerMetrics
from omniloop.serve.dynamo.roles import WorkerRoles, runtime_config, worker_roles
from omniloop.serve.warmup import run_warmup, warmup_shapes
from omniloop.serve.wire import ServedModel

logger = logging.getLogger(__name__)
MODALITIES = ("videos", "images")
DISCOVERY_BACKENDS = ("etcd", "file", "kubernetes", "mem")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    model: str  # checkpoint directory or built-in model name
    served_model_name: str | None = None  # what clients pass as "model"; default: the directory name
    namespace: str = "dynamo"
    component: str = "omniloop"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    modalities: tuple[str, ...] | None = None  # None: every modality the model's tasks allow
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: in-flight requests get this long, then are cancelled
    # None: one request at the model's default shape, clamped (serve/warmup.py); (): no warmup
    warmup: tuple[DiffusionParams, ...] | None = None
    deploy: DeployConfig = field(default_factory=DeployConfig)

    def __post_init__(self) -> None:
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise ValueError(f"discovery_backend={self.discovery_backend!r}; pass one of {list(DISCOVERY_BACKENDS)}")
        if self.request_plane not in ("tcp", "nats"):
            raise ValueError(f"request_plane={self.request_plane!r}; pass 'tcp' or 'nats'")
        unknown = sorted(set(self.modalities or ()) - set(MODALITIES))
        if unknown or self.modalities == ():
            raise ValueError(f"modalities={self.modalities}; pass a non-empty subset of {list(MODALITIES)}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s}; pass seconds in [0, 3600]")
        for name in ("namespace", "component"):
            value = getattr(self, name)
            if not value or "." in value or "/" in value:
                raise ValueError(f"{name}={value!r}; pass a name without '.' or '/'")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name or self.model


def run_worker(config: WorkerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    uvloop.run(_serve(config))
    return 0


async def _serve(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # a signal before we serve: skip registration, exit cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime = DistributedRuntime(loop, config.discovery_backend, config.request_plane)

    t0 = time.perf_counter()
    engine = await asyncio.to_thread(AsyncEngine.from_pretrained, config.model, deploy=config.deploy)
    model = ServedModel.of(engine, config.served_model_name)
    try:
        shapes = warmup_shapes(None if config.warmup is None else list(config.warmup), model.defaults, model.limits,
                               model.tasks)
        await run_warmup(engine, shapes, model.tasks, model.defaults, mask=model.takes_mask,
                         control=model.takes_control)
    except BaseException:
        await asyncio.to_thread(engine.shutdown)
        runtime.shutdown()
        raise
    logger.info("model %s loaded and warm in %.2fs", config.name, time.perf_counter() - t0)
    # NOTE: loop signal callbacks run only at an await, so none can slip in between this
    # check and install_signal_handlers below (which replaces our early handler).
    if stop.is_set():
        logger.info("signal received before serving; exiting without registering")
        await asyncio.to_thread(engine.shutdown)
        runtime.shutdown()
        return

    metrics = WorkerMetrics(engine)
    handler = GenerationHandler(engine, model, metrics, drain_timeout_s=config.drain_timeout_s)
    served = _served_modalities(model, config.modalities)
    endpoints = {m: runtime.endpoint(f"{config.namespace}.{config.component}.{m}") for m in served}
    first = served[0]
    metrics.export(endpoints[first], namespace=config.namespace, component=config.component, endpoint_name=first,
                   model=model.name)
    install_signal_handlers(loop, runtime, endpoints.values(), drain_callback=handler.drain,
                            cleanup_callback=lambda: asyncio.to_thread(engine.shutdown))
    roles = worker_roles(engine.engine.pipeline.spec, config.deploy)
    await _register(endpoints, config.model, model.name, roles)
    logger.info("serving %s as %s on %s.%s.{%s}, roles %s", config.model, model.name, config.namespace,
                config.component, ",".join(served), ",".join(roles.roles))
    handlers = {"videos": handler.videos, "images": handler.images}
    await asyncio.gather(*(
        ep.serve_endpoint(handlers[m], graceful_shutdown=True, health_check_payload={HEALTH_CHECK_KEY: True})
        for m, ep in endpoints.items()
    ))
    logger.info("worker stopped")


def _served_modalities(model: ServedModel, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
    able = tuple(m for m, ok in (("videos", model.serves_videos), ("images", model.serves_images)) if ok)
    if wanted is None:
        if not able:
            raise ValueError(f"model {model.name!r} (tasks {sorted(t.value for t in model.tasks)}) makes neither "
                             "videos nor images")
        return able
    missing = sorted(set(wanted) - set(able))
    if missing:
        raise ValueError(f"modalities {missing} are not served by {model.name!r} "
                         f"(tasks {sorted(t.value for t in model.tasks)}); pass a subset of {list(able)}")
    return tuple(m for m in MODALITIES if m in wanted)


async def _register(endpoints: dict, model_path: str, name: str, roles: WorkerRoles) -> None:
    types = {"videos": ModelType.Videos, "images": ModelType.Images}
    for modality, endpoint in endpoints.items():
        # One worker owns the whole graph (its role pools are engine-internal): Dynamo 1.6.1's
        # WorkerType cannot name our roles (serve/dynamo/roles.py); they go in the runtime config.
        await register_model(ModelInput.Text, types[modality], endpoint, model_path, name,
                             worker_type=WorkerType.Aggregated, needs=[], runtime_config=runtime_config(roles))
