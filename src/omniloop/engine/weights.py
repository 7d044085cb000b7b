"""The weight plane (design §8.6): ``update_weights``, ``weight_version``, ``sleep`` / ``wake``.

Every operation is a **barrier at a step boundary**: it is queued (``WeightPlane.schedule_*``,
from any thread; a bad update is refused there, before anything is queued) and applied by the
engine thread at the top of a ``step()`` once no request runs on the weights it changes:

* ``running="finish"``: requests already running finish on the old weights; no waiting request
  starts meanwhile; the op applies when the running set is empty;
* ``running="requeue"``: running requests lose their progress and wait again (their resolved
  request, seeds included, is admitted afresh), the op applies at once, and they run on the
  new weights.

An update is **atomic**: every tensor is checked (name, shape, dtype kind, finite) against the
loaded module before one byte is copied, so a refused update leaves the engine serving the old
version bit for bit. It copies in place (parameters keep their identity: LoRA wrappers, a
trainer holding the module and ``torch.compile`` keep working); a source tensor that *is* the
engine's (the trainer's module is the engine's, library mode) is not copied. It then bumps
the text-embedding cache's epoch and drops captured CUDA graphs.

``sleep(1)`` releases the weights of the components the request loops step (the DiT / LM) and
the KV pools, keeping the VAE and text encoders resident; ``sleep(2)`` releases every module
and cache. Released weights go to a **host copy** (on a CUDA device: a CPU copy; on a CPU
device the tensors themselves are kept aside), and ``wake()`` restores them from it, so
weights updated before the sleep survive it and outputs after wake equal those before. Requests
arriving while asleep wait (``while_asleep="wait"``) or are refused as ``asleep`` (a 503 with
Retry-After on HTTP).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import nn

from omniloop.engine.sleep import ReleasableStorage, Released, SleepReport, loop_components
from omniloop.engine.weight_update import (CopyPlan, WeightSource, WeightUpdateRefused, check_version,
                                           component_module, plan_copy, resolve_source, version_key)
from omniloop.request import ErrorKind, RequestStatus, StatusEvent

if TYPE_CHECKING:
    from omniloop.engine.engine import Engine

__all__ = ["DEFAULT_ROLE", "INITIAL_VERSION", "CopyPlan", "Running", "SleepReport", "WeightInfo", "WeightPlane",
           "WeightSource", "WeightUpdateRefused", "WhileAsleep", "version_key"]

Running = Literal["finish", "requeue"]
WhileAsleep = Literal["wait", "reject"]
INITIAL_VERSION = "0"  # the checkpoint's weights, as loaded
DEFAULT_ROLE = "policy"  # what pushed weights are (design §8.6: student / EMA / blended old policy)


@dataclass(frozen=True)
class WeightInfo:
    """The weights the engine serves: what ``GET /v1/weights`` answers."""

    version: str
    role: str
    updated_at: float  # unix time of the last swap (the load, for the initial version)
    component: str | None = None  # the component last updated (None: as loaded)
    copied_tensors: int = 0  # tensors the last update copied (0: the source was the engine's own)
    seconds: float = 0.0  # the last update's copy time (the barrier's wait excluded)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "role": self.role, "updated_at": self.updated_at,
                "component": self.component}


# -- the plane -----------------------------------------------------------------------------


@dataclass
class _Op:
    kind: Literal["update", "sleep", "wake"]
    running: Running
    apply: Callable[[], Any]
    future: Future = field(default_factory=Future)


class WeightPlane:
    """The engine's weight state and its queued barrier ops (one per engine)."""

    def __init__(self, engine: Engine, *, while_asleep: WhileAsleep = "wait") -> None:
        self._engine = engine
        self.info = WeightInfo(version=INITIAL_VERSION, role="checkpoint", updated_at=time.time())
        self.updates = 0
        self.asleep: int = 0  # sleep level (0: awake)
        self.while_asleep: WhileAsleep = while_asleep
        self._released: dict[str, Released] = {}
        self._pending: deque[_Op] = deque()
        self._lock = threading.Lock()
        self._queued_version = INITIAL_VERSION  # the newest version accepted (maybe not applied yet)

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    # -- scheduling (any thread) -------------------------------------------------------------
    def schedule_update(self, source: WeightSource, version: Any, *, role: str = DEFAULT_ROLE,
                        component: str = "transformer", running: Running = "finish") -> Future:
        """Check the update now (raises WeightUpdateRefused, nothing queued) and queue it."""
        _check_running(running)
        if self.asleep:
            raise WeightUpdateRefused("the engine is asleep: wake() it before updating weights", field="version")
        pipeline = self._engine.pipeline
        module = component_module(pipeline, component)
        with self._lock:
            version = check_version(version, self._queued_version)
        if source is module:
            plan = CopyPlan([], shared=len(module.state_dict()))
        else:
            plan = plan_copy(module, resolve_source(source), pipeline.checkpoint_layouts.get(component),
                             component)
        with self._lock:  # another update may have been accepted meanwhile
            version = check_version(version, self._queued_version)
            self._queued_version = version
            op = _Op("update", running, lambda: self._apply_update(plan, version, role, component))
            self._pending.append(op)
        return op.future

    def schedule_sleep(self, level: int, *, running: Running = "finish") -> Future:
        _check_running(running)
        if level not in (1, 2):
            raise WeightUpdateRefused(f"{level!r}; pass 1 (release the DiT/LM weights and KV caches, keep the "
                                      "VAE and text encoders) or 2 (release everything)", field="level")
        op = _Op("sleep", running, lambda: self._apply_sleep(level))
        with self._lock:
            self._pending.append(op)
        return op.future

    def schedule_wake(self) -> Future:
        op = _Op("wake", "finish", self._apply_wake)
        with self._lock:
            self._pending.append(op)
        return op.future

    def check_accepting(self) -> None:
        """Admission while asleep: refused as ``asleep`` when configured so (else it waits)."""
        if self.asleep and self.while_asleep == "reject":
            from omniloop.engine.errors import QueueFull

            raise QueueFull(f"the engine is asleep (level {self.asleep}): it serves again after wake",
                            hint="retry after the weights are woken (POST /v1/wake)", kind=ErrorKind.ASLEEP)

    def idle_s(self) -> float | None:
        """While asleep with nothing queued for the plane: nothing can run (inf)."""
        return math.inf if self.asleep and not self._pending else None

    def on_pipeline_rebuilt(self) -> None:
        """A pool restart rebuilt the pipeline from the checkpoint: its weights are served again
        (later updates must still be newer than any accepted before)."""
        self.info = WeightInfo(version=INITIAL_VERSION, role="checkpoint", updated_at=time.time())
        self._released.clear()
        self.asleep = 0

    # -- the barrier (engine thread, top of step) ---------------------------------------------
    def at_boundary(self) -> None:
        scheduler = self._engine.scheduler
        while self._pending:
            op = self._pending[0]
            if op.kind != "wake" and scheduler.running:
                if op.running == "requeue":
                    self._requeue_running()
                else:
                    scheduler.hold_admission = True  # the running ones finish on the old weights first
                    return
            self._pending.popleft()
            try:
                # NOTE: the engine thread runs in inference mode; tensors made there are inference
                # tensors, which a trainer holding the module could not backpropagate through
                with torch.inference_mode(False), torch.no_grad():
                    result = op.apply()
                op.future.set_result(result)
            except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on serving
                op.future.set_exception(e)
        scheduler.hold_admission = bool(self.asleep)

    def _requeue_running(self) -> None:
        engine = self._engine
        scheduler = engine.scheduler
        for req in list(scheduler.running.values()):
            if req.loop is not None and req.node is not None:
                req.node.stage.release(req.loop)  # e.g. its KV blocks
        for req in scheduler.requeue_running():
            req.state.release_refs()
            req.state = engine.pipeline.admit(req.state.request)  # the resolved request: same seeds
            req.nodes = engine.pipeline.active_nodes(req.request)
            engine._emit(StatusEvent(request_id=req.request_id, status=RequestStatus.QUEUED))

    # -- ops (engine thread, nothing running) ------------------------------------------------------
    def _apply_update(self, plan: CopyPlan, version: str, role: str, component: str) -> WeightInfo:
        t0 = time.perf_counter()
        copied = plan.apply()
        device = self._engine.pipeline.device
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        self._invalidate_caches()
        self.updates += 1
        self.info = WeightInfo(version=version, role=role, updated_at=time.time(), component=component,
                               copied_tensors=copied, seconds=seconds)
        return self.info

    def _invalidate_caches(self) -> None:
        """What was computed with (or captured over) the old weights goes: text embeddings (a new
        epoch) and CUDA graphs."""
        caches = self._engine.pipeline.caches
        text = caches.get("text_embeddings")
        if text is not None:
            text.bump_epoch()
        graphs = caches.get("cuda_graphs")
        if graphs is not None:
            graphs.clear()

    def _apply_sleep(self, level: int) -> SleepReport:
        t0 = time.perf_counter()
        pipeline = self._engine.pipeline
        names = loop_components(pipeline) if level == 1 else set(pipeline.components)
        released, freed = [], 0
        for name in sorted(names):
            obj = pipeline.components.get(name)
            if isinstance(obj, ReleasableStorage):
                freed += obj.drop_storage()
                released.append(name)
                continue
            module = obj if isinstance(obj, nn.Module) else getattr(obj, "model", None)
            if isinstance(module, nn.Module) and name not in self._released:
                freed += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                             if t.device.type != "cpu")
                self._released[name] = Released.of(module)
                released.append(name)
        for obj in pipeline.components.values():  # KV pools bound by other nodes too
            if isinstance(obj, ReleasableStorage):
                freed += obj.drop_storage()
        self._invalidate_caches()  # graphs hold the old addresses; level 2 also drops the embeddings
        if level == 2:
            text = pipeline.caches.get("text_embeddings")
            if text is not None:
                text.bump_epoch()
        if torch.device(pipeline.device).type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = max(self.asleep, level)
        return SleepReport(level, freed, tuple(released), time.perf_counter() - t0)

    def _apply_wake(self) -> SleepReport:
        t0 = time.perf_counter()
        names = tuple(sorted(self._released))
        restored = 0
        for released in self._released.values():
            released.restore()
            restored += sum(h.numel() * h.element_size() for _, h, d in released.tensors if d.type != "cpu")
        self._released.clear()
        device = self._engine.pipeline.device
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        level, self.asleep = self.asleep, 0
        return SleepReport(level, restored, names, time.perf_counter() - t0)


def _check_running(running: Any) -> None:
    if running not in ("finish", "requeue"):
        raise WeightUpdateRefused(f"{running!r}; pass 'finish' (running requests end on the old weights) "
                                  "or 'requeue' (they start over on the new ones)", field="running")
