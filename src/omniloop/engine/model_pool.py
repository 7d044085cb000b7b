"""``ModelPool``: several models served by one engine loop on one device.

Each model has its own ``Engine`` (its scheduler, batches, cost model); the pool routes a
request by ``OmniRequest.model`` and decides, once per iteration, which model's engine
steps. Weights live in one of three tiers — device, host (CPU memory), disk (not loaded)
— with an LRU and a byte budget in the first two:

* a model whose weights are on the device steps at once; among several, the one whose
  oldest pending request arrived first;
* a model off the device pays a **transition** (moving its weights host -> device, or
  loading them from disk), priced as bytes / transfer rate. The pool keeps stepping
  resident models while the off-device model's oldest request has waited less than
  ``switch_after`` transitions (so one divergent request does not thrash the device), then
  makes it resident, evicting least-recently-used idle models to the host (and, over the
  host budget, to disk) to fit. A model with requests in flight is never evicted.

Offloading a model moves its modules in place (``module.to``), so its engine, pipeline and
queued requests stay as they are; its text-embedding rows are dropped and its adapters'
device copies released.

The pool offers the ``Engine`` surface ``AsyncEngine`` drives (``add_request``, ``step``,
``abort``, ``pop_output``...), so ``AsyncEngine(ModelPool(...))`` serves several models.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from omniloop.engine.checkpoints import LoopCheckpoints
from omniloop.engine.engine import Engine, EngineConfig, EngineStats, EventSink
from omniloop.engine.engine_like import CostSnapshots
from omniloop.engine.errors import RequestRejected, UnknownRequest
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import ErrorKind, OmniOutput, OmniRequest

logger = logging.getLogger(__name__)

Tier = Literal["device", "host", "disk"]


@dataclass
class ModelSlot:
    name: str
    build: Callable[[], Pipeline]  # disk -> a pipeline on the pool's device
    engine: Engine | None = None
    tier: Tier = "disk"
    nbytes: int = 0
    last_used: float = 0.0
    arrivals: dict[str, float] = field(default_factory=dict)  # pending request id -> arrival time
    loras: list[tuple[str, str]] = field(default_factory=list)  # (name, file) registered when dropped to disk

    @property
    def busy(self) -> bool:
        """Requests in flight: their loop states hold device tensors, so no eviction."""
        return self.engine is not None and self.engine.num_running() > 0

    def loaded(self) -> Engine:
        """The slot's engine, for a slot the pool has loaded (tier device or host)."""
        assert self.engine is not None, f"model {self.name!r} is on disk; the pool loads it first"
        return self.engine

    def oldest(self) -> float | None:
        return min(self.arrivals.values()) if self.arrivals else None


@dataclass
class PoolStats:
    transitions: int = 0  # host/disk -> device moves
    transition_s: float = 0.0
    evictions_to_host: int = 0
    evictions_to_disk: int = 0
    disk_loads: int = 0


class PoolEngineStats:
    """The engines' counters summed (an ``EngineStatsView``); ``rejected`` also counts the
    pool's own rejections, the one counter callers add to."""

    def __init__(self, pool: "ModelPool") -> None:
        self._pool = pool

    def _sum(self, counter: Callable[[EngineStats], int]) -> int:
        return sum(counter(s.engine.stats) for s in self._pool.slots.values() if s.engine is not None)

    @property
    def completed(self) -> int:
        return self._sum(lambda s: s.completed)

    @property
    def failed(self) -> int:
        return self._sum(lambda s: s.failed)

    @property
    def cancelled(self) -> int:
        return self._sum(lambda s: s.cancelled)

    @property
    def pool_restarts(self) -> int:
        return self._sum(lambda s: s.pool_restarts)

    @property
    def steps(self) -> int:
        return self._sum(lambda s: s.steps)

    @property
    def batched_steps(self) -> int:
        return self._sum(lambda s: s.batched_steps)

    @property
    def rejected(self) -> int:
        return self._sum(lambda s: s.rejected) + self._pool._rejected

    @rejected.setter
    def rejected(self, value: int) -> None:
        self._pool._rejected += value - self.rejected


def pipeline_bytes(pipeline: Pipeline) -> int:
    """Bytes of every parameter and buffer of the pipeline's modules (encoders included)."""
    total = 0
    for component in pipeline.components.values():
        module = component if isinstance(component, torch.nn.Module) else getattr(component, "model", None)
        if isinstance(module, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return total


def move_pipeline(pipeline: Pipeline, device: torch.device | str) -> None:
    """Every module of the pipeline to ``device``, in place (identity kept)."""
    for component in pipeline.components.values():
        module = component if isinstance(component, torch.nn.Module) else getattr(component, "model", None)
        if isinstance(module, torch.nn.Module):
            module.to(device)
    text = pipeline.caches.get("text_embeddings")
    if text is not None:
        text.bump_epoch()  # its rows live on the old device
    adapters = pipeline.caches.get("adapters")
    if adapters is not None:
        adapters.drop_device_copies()
    graphs = pipeline.caches.get("cuda_graphs")
    if graphs is not None:
        graphs.clear()  # captured graphs read the weights' old device addresses


class ModelPool:
    def __init__(
        self,
        models: dict[str, Callable[[], Pipeline]],
        config: EngineConfig | None = None,
        *,
        default: str | None = None,
        device_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        transfer_bytes_per_s: float = 20e9,
        switch_after: float = 2.0,
        sources: dict[str, tuple[str, ...]] | None = None,
        load_options: LoadOptions | None = None,
        prepare: Callable[[Pipeline], Pipeline] | None = None,
    ) -> None:
        if not models:
            raise ValueError("a model pool needs at least one model")
        self.config = config or EngineConfig()
        self.slots = {name: ModelSlot(name, build) for name, build in models.items()}
        self.sources = dict(sources or {})  # name -> other names clients may use (the checkpoint path)
        # how the pool's models were loaded, for models added later (add_model's builders):
        # the deployment's load options and what wraps a loaded pipeline (its plugins)
        self.load_options = load_options
        self.prepare: Callable[[Pipeline], Pipeline] = prepare or (lambda pipeline: pipeline)
        self.default = default or next(iter(models))
        if self.default not in self.slots:
            raise ValueError(f"default model {self.default!r} is not one of {sorted(self.slots)}")
        self.device_budget = device_budget_bytes
        self.host_budget = host_budget_bytes
        self.transfer_bytes_per_s = transfer_bytes_per_s
        self.switch_after = switch_after
        self.pool_stats = PoolStats()
        self._rejected = 0
        self._event_sink: EventSink | None = None
        self._checkpoints: LoopCheckpoints | None = None
        self._accepting = True
        self._owner: dict[str, str] = {}  # request id -> model
        self._lock = threading.Lock()
        self.device: torch.device | None = None  # the first pipeline's; every model serves on it
        self.stats = PoolEngineStats(self)
        for slot in self.slots.values():
            self._load(slot)  # everything starts loaded; over budget, the LRU goes to the host

    def add_model(self, name: str, build: Callable[[], Pipeline]) -> None:
        """Serve one more model (on disk until its first request loads it). The slots dict is
        replaced, not mutated: the engine thread may be iterating the old one."""
        if name in self.slots:
            raise ValueError(f"model {name!r} is already served here")
        self.slots = {**self.slots, name: ModelSlot(name, build)}

    # -- the Engine surface -----------------------------------------------------------------
    def add_request(self, request: OmniRequest, *, paused: bool = False) -> str:
        slot = self._slot_for(request)
        if slot.engine is None:  # on disk: admission needs the pipeline (its validator)
            self._load(slot)
        rid = slot.loaded().add_request(request, paused=paused)
        with self._lock:
            self._owner[rid] = slot.name
            slot.arrivals[rid] = time.perf_counter()
        return rid

    def step(self) -> list[OmniOutput]:
        slot = self._pick()
        if slot is None:
            return []
        if slot.tier != "device":
            self._make_resident(slot)
        outs = slot.loaded().step()
        slot.last_used = time.perf_counter()
        with self._lock:
            for out in outs:
                slot.arrivals.pop(out.request_id, None)
        return outs

    def abort(self, request_id: str, *, forget: bool = False, reason: str | None = None) -> None:
        self._engine_of(request_id).abort(request_id, forget=forget, reason=reason)

    def pop_output(self, request_id: str) -> OmniOutput | None:
        slot = self._owner_of(request_id)
        if slot is None or slot.engine is None:
            return None
        out = slot.engine.pop_output(request_id)
        if out is not None:
            with self._lock:
                self._owner.pop(request_id, None)
                slot.arrivals.pop(request_id, None)
        return out

    def has_unfinished(self) -> bool:
        return any(s.engine is not None and s.engine.has_unfinished() for s in self.slots.values())

    def idle_s(self) -> float | None:
        """Seconds until some model's work can run (0: now; None: nothing anywhere)."""
        waits = [w for s in self.slots.values() if s.engine is not None and (w := s.engine.idle_s()) is not None]
        return min(waits) if waits else None

    def send(self, request_id: str, item: Any) -> None:
        self._engine_of(request_id).send(request_id, item)

    def pause(self, request_id: str) -> None:
        self._engine_of(request_id).pause(request_id)

    def resume(self, request_id: str) -> None:
        self._engine_of(request_id).resume(request_id)

    def is_tracked(self, request_id: str) -> bool:
        slot = self._owner_of(request_id)
        return slot is not None and slot.engine is not None and slot.engine.is_tracked(request_id)

    def tracked_ids(self) -> list[str]:
        return [rid for s in self.slots.values() if s.engine is not None for rid in s.engine.tracked_ids()]

    def num_waiting(self) -> int:
        return sum(s.engine.num_waiting() for s in self.slots.values() if s.engine is not None)

    def num_running(self) -> int:
        return sum(s.engine.num_running() for s in self.slots.values() if s.engine is not None)

    def predicted_backlog_s(self) -> float:
        return sum(s.engine.predicted_backlog_s() for s in self.slots.values() if s.engine is not None)

    def plugin_metrics(self) -> dict[str, Any]:
        return {n: s.engine.plugin_metrics() for n, s in self.slots.items() if s.engine is not None}

    @property
    def event_sink(self) -> EventSink | None:
        return self._event_sink

    @event_sink.setter
    def event_sink(self, sink: EventSink | None) -> None:
        self._event_sink = sink
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.event_sink = sink

    @property
    def checkpoints(self) -> LoopCheckpoints | None:
        return self._checkpoints

    @checkpoints.setter
    def checkpoints(self, store: LoopCheckpoints | None) -> None:
        self._checkpoints = store  # one store for every model: request ids are unique across them
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.checkpoints = store

    @property
    def accepting(self) -> bool:
        return self._accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._accepting = value
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.accepting = value

    @property
    def cost_model(self) -> CostSnapshots:
        return _Snapshots(self)

    @property
    def pipeline(self) -> Pipeline:
        """The default model's pipeline (what single-model callers read)."""
        return self.pipelines()[self.default]

    def loaded_pipelines(self) -> dict[str, Pipeline]:
        """The pipelines in memory (device or host tier), without loading any from disk."""
        return {n: s.engine.pipeline for n, s in self.slots.items() if s.engine is not None}

    def pipelines(self) -> dict[str, Pipeline]:
        for slot in self.slots.values():
            if slot.engine is None:
                self._load(slot)
        return {n: s.loaded().pipeline for n, s in self.slots.items()}

    # -- residency --------------------------------------------------------------------------
    def residency(self) -> dict[str, dict[str, Any]]:
        return {n: {"tier": s.tier, "bytes": s.nbytes, "pending": len(s.arrivals)} for n, s in self.slots.items()}

    def transition_s(self, slot: ModelSlot) -> float:
        """Predicted seconds to make ``slot`` device-resident (the cost a switch is charged)."""
        return slot.nbytes / self.transfer_bytes_per_s if slot.tier == "host" else 10 * slot.nbytes / self.transfer_bytes_per_s

    def _pick(self) -> ModelSlot | None:
        now = time.perf_counter()
        ready = [s for s in self.slots.values() if s.engine is not None and s.engine.has_unfinished()]
        ready += [s for s in self.slots.values() if s.engine is None and s.arrivals]
        if not ready:
            return None
        resident = [s for s in ready if s.tier == "device"]
        waiting = sorted((s for s in ready if s.tier != "device"), key=lambda s: s.oldest() or now)
        for slot in waiting:  # an off-device model whose requests waited long enough, if it can fit
            waited = now - (slot.oldest() or now)
            if (not resident or waited >= self.switch_after * self.transition_s(slot)) and self._can_fit(slot):
                return slot
        if resident:  # one with work to do now first: a paused or paced request's model waits
            runnable = [s for s in resident if s.engine is not None and s.engine.idle_s() == 0] or resident
            return min(runnable, key=lambda s: s.oldest() or now)
        return None  # nothing resident has work and nothing fits: wait for running requests

    def _device_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values() if s.tier == "device")

    def _can_fit(self, slot: ModelSlot) -> bool:
        """Room on the device once idle models are evicted; a model alone on the device always
        fits (a budget below one model's size cannot refuse it forever)."""
        if self.device_budget is None:
            return True
        others = [s for s in self.slots.values() if s.tier == "device" and s is not slot]
        kept = [s for s in others if s.busy or s.arrivals]
        return not kept or slot.nbytes + sum(s.nbytes for s in kept) <= self.device_budget

    def _make_resident(self, slot: ModelSlot) -> None:
        t0 = time.perf_counter()
        if slot.engine is None:
            self._load(slot)
        self._evict_for(slot)
        if slot.tier == "host":
            assert self.device is not None, f"model {slot.name} on the host before any model loaded"
            move_pipeline(slot.loaded().pipeline, self.device)
            slot.tier = "device"
        self.pool_stats.transitions += 1
        self.pool_stats.transition_s += time.perf_counter() - t0
        logger.info("model %s now on the device (%.2f s)", slot.name, time.perf_counter() - t0)

    def _evict_for(self, slot: ModelSlot) -> None:
        if self.device_budget is None:
            return
        idle = sorted((s for s in self.slots.values() if s.tier == "device" and s is not slot and not s.busy
                       and not s.arrivals), key=lambda s: s.last_used)
        while self._device_bytes() + (slot.nbytes if slot.tier != "device" else 0) > self.device_budget and idle:
            self._offload(idle.pop(0))

    def _offload(self, slot: ModelSlot) -> None:
        move_pipeline(slot.loaded().pipeline, "cpu")
        slot.tier = "host"
        self.pool_stats.evictions_to_host += 1
        if self.host_budget is None:
            return
        hosted = sorted((s for s in self.slots.values() if s.tier == "host" and not s.arrivals and s is not slot),
                        key=lambda s: s.last_used)
        while sum(s.nbytes for s in self.slots.values() if s.tier == "host") > self.host_budget and hosted:
            victim = hosted.pop(0)
            adapters = victim.loaded().pipeline.caches.get("adapters")
            # LoRAs loaded while serving (not only the deploy config's): registered again on reload
            victim.loras = [(i["name"], i["source"]) for i in adapters.list()] if adapters is not None else []
            victim.engine, victim.tier = None, "disk"
            self.pool_stats.evictions_to_disk += 1

    def _load(self, slot: ModelSlot) -> None:
        pipeline = slot.build()
        adapters = pipeline.caches.get("adapters")
        for name, source in slot.loras:
            if adapters is not None and name not in adapters:
                adapters.load(name, source)
        if self.device is None:
            self.device = pipeline.device
        assert pipeline.device == self.device, f"model {slot.name} loads on {pipeline.device}, the pool serves on {self.device}"
        slot.engine = Engine(pipeline, self.config, event_sink=self._event_sink, restart_pool=slot.build)
        slot.engine.accepting = self._accepting
        slot.engine.checkpoints = self._checkpoints
        slot.nbytes, slot.tier, slot.last_used = pipeline_bytes(pipeline), "device", time.perf_counter()
        self.pool_stats.disk_loads += 1
        self._evict_for(slot)
        if self.device_budget is not None and self._device_bytes() > self.device_budget and not slot.arrivals:
            self._offload(slot)  # does not fit beside busy models: wait on the host

    # -- routing ----------------------------------------------------------------------------
    def _slot_for(self, request: OmniRequest) -> ModelSlot:
        name = request.model or self.default
        slot = self.slots.get(name)
        if slot is None:
            self._rejected += 1
            raise RequestRejected(f"model {name!r} is not served here", hint=f"pass one of {sorted(self.slots)}",
                                  fields=("model",), kind=ErrorKind.UNKNOWN_MODEL)
        return slot

    def _owner_of(self, request_id: str) -> ModelSlot | None:
        """The slot of the model serving ``request_id`` (None: not a request of this pool)."""
        name = self._owner.get(request_id)
        return self.slots[name] if name is not None else None

    def _engine_of(self, request_id: str) -> Engine:
        slot = self._owner_of(request_id)
        if slot is None or slot.engine is None:
            raise UnknownRequest(f"no request {request_id!r}; pass the id add_request returned")
        return slot.engine


class _Snapshots:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def snapshot(self) -> dict[str, float]:
        """Every loaded model's calibration, keys ``<model>/<item>`` (one flat map, as one engine's)."""
        return {f"{n}/{k}": v for n, s in self.pool.slots.items() if s.engine is not None
                for k, v in s.engine.cost_model.snapshot().items()}

