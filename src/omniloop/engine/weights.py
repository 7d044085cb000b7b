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
import re
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

from omniloop.request import ErrorKind, RequestStatus, StatusEvent

if TYPE_CHECKING:
    from omniloop.engine.engine import Engine
    from omniloop.pipeline.pipeline import Pipeline

Running = Literal["finish", "requeue"]
WhileAsleep = Literal["wait", "reject"]
WeightSource = str | Path | Mapping[str, torch.Tensor] | nn.Module
INITIAL_VERSION = "0"  # the checkpoint's weights, as loaded
DEFAULT_ROLE = "policy"  # what pushed weights are (design §8.6: student / EMA / blended old policy)


class WeightUpdateRefused(ValueError):
    """An update (or sleep/wake call) refused before anything changed; ``field`` names what
    the caller passed wrong (``version``, ``source``, ``component``, ``running``, ``level``)."""

    def __init__(self, detail: str, *, field: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail  # the message without the field's name (a front end names its own)


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


@runtime_checkable
class ReleasableStorage(Protocol):
    """A cache pool whose storage the engine may drop while nothing holds it (sleep)."""

    def drop_storage(self) -> int: ...


# -- versions ------------------------------------------------------------------------------


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: digit runs compare as numbers ("step-9" < "step-10", "2" < "10")."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"\d+|\D+", version))


def check_version(version: Any, current: str) -> str:
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not version.strip() or len(version) > 128:
        raise WeightUpdateRefused(f"{version!r} is not a version; pass a non-empty string (or int) of at "
                                  "most 128 characters, newer than the current one", field="version")
    if version_key(version) <= version_key(current):
        raise WeightUpdateRefused(f"{version!r} is not newer than the current version {current!r} "
                                  "(versions order naturally: digit runs as numbers); pass a newer one",
                                  field="version")
    return version


# -- sources -> a checked copy plan -----------------------------------------------------------


def component_module(pipeline: Pipeline, component: str) -> nn.Module:
    """The nn.Module of ``component`` (an encoder wrapper's ``model``)."""
    obj = pipeline.components.get(component)
    module = obj if isinstance(obj, nn.Module) else getattr(obj, "model", None)
    if not isinstance(module, nn.Module):
        modules = sorted(n for n, c in pipeline.components.items()
                         if isinstance(c, nn.Module) or isinstance(getattr(c, "model", None), nn.Module))
        raise WeightUpdateRefused(f"{component!r} is not a module of this pipeline; pass one of {modules}",
                                  field="component")
    return module


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        raise WeightUpdateRefused(f"{path.name!r} is not a .safetensors file that exists; pass a "
                                  "safetensors file (a checkpoint's transformer/*.safetensors)", field="source")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file
        raise WeightUpdateRefused(f"cannot read {path.name!r} as safetensors: {e}", field="source") from None


@dataclass
class CopyPlan:
    """Checked (target, source) pairs of one update; ``apply`` copies them in place."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    shared: int = 0  # source tensors that are the targets themselves (not copied)

    @torch.no_grad()
    def apply(self) -> int:
        for target, source in self.pairs:
            target.copy_(source)
        return len(self.pairs)


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    def kind(d: torch.dtype) -> str:
        return "complex" if d.is_complex else "float" if d.is_floating_point else "bool" if d == torch.bool else "int"
    return kind(a) == kind(b)


_FP8 = {d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                         "float8_e5m2fnuz")) if d is not None}


def plan_copy(module: nn.Module, source: Mapping[str, torch.Tensor], layout: Callable[..., dict] | None,
              component: str) -> CopyPlan:
    """Check ``source`` against ``module`` and pair each tensor with its target. A partial
    state dict (one shard) is fine; an unknown name, a wrong shape, a dtype of another kind
    (an integer tensor for a float weight), a quantized target or a non-finite value is
    refused naming the first offender. Floating tensors are cast to the target's dtype, as
    loading does. ``source`` may use the module's own names or, through ``layout``, the
    checkpoint files' names."""
    targets = module.state_dict(keep_vars=True)
    names = source
    converted = False
    if any(k not in targets for k in source) and layout is not None:
        try:
            names = layout(dict(source))
        except KeyError as e:  # the layout converts whole groups (q/k/v, gate/up) or the whole model
            raise WeightUpdateRefused(f"the checkpoint's tensor {e} is missing; its layout converts complete groups: "
                                      "pass the whole state dict (or our module's own names)", field="source") from None
        except (ValueError, RuntimeError) as e:  # an incomplete fused group (one of q/k/v)
            raise WeightUpdateRefused(f"{e}", field="source") from None
        converted = True
    where = " (converted from the checkpoint's names)" if converted else ""
    if not names:
        raise WeightUpdateRefused("it holds no tensors; pass the component's weights", field="source")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    shared = 0
    for name, tensor in names.items():
        target = targets.get(name)
        if target is None:
            raise WeightUpdateRefused(f"tensor {name!r}{where} is not a weight of component {component!r}; "
                                      f"pass its state dict's names or its checkpoint's (e.g. "
                                      f"{next(iter(targets), '')!r})", field="source")
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateRefused(f"{name!r} is a {type(tensor).__name__}, not a tensor", field="source")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightUpdateRefused(f"tensor {name!r}{where} has shape {tuple(tensor.shape)}, component "
                                      f"{component!r} holds {tuple(target.shape)}; pass weights of the served "
                                      "architecture", field="source")
        if target.dtype in _FP8:
            raise WeightUpdateRefused(f"{name!r} is stored quantized ({target.dtype}) in this deployment; "
                                      "update weights of an unquantized deployment", field="source")
        if not _same_kind(tensor.dtype, target.dtype):
            raise WeightUpdateRefused(f"tensor {name!r}{where} has dtype {tensor.dtype}, component "
                                      f"{component!r} holds {target.dtype}; pass a tensor of that kind",
                                      field="source")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateRefused(f"tensor {name!r}{where} holds NaN or Inf; pass finite weights",
                                      field="source")
        if tensor.data_ptr() == target.data_ptr() and tensor.dtype == target.dtype and tensor.device == target.device:
            shared += 1  # the engine's own tensor (the trainer's module is the engine's): nothing to copy
            continue
        pairs.append((target.data, tensor))
    return CopyPlan(pairs, shared)


def resolve_source(source: WeightSource) -> Mapping[str, torch.Tensor]:
    """The tensors of ``source``: a module's state dict, a safetensors file's, or the mapping."""
    if isinstance(source, nn.Module):
        return source.state_dict(keep_vars=True)
    if isinstance(source, (str, Path)):
        return read_safetensors(source)
    if isinstance(source, Mapping):
        return source
    raise WeightUpdateRefused(f"a {type(source).__name__}; pass a safetensors path, a state dict or a "
                              "module", field="source")


# -- sleep ---------------------------------------------------------------------------------


@dataclass
class _Released:
    """One module's tensors put aside by a sleep: (tensor object, its data kept on the host)."""

    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.device]]

    @classmethod
    @torch.no_grad()
    def of(cls, module: nn.Module) -> "_Released":
        kept = []
        seen: set[int] = set()
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            device = t.device
            # NOTE: a CPU deployment keeps the tensor's own storage aside (nothing to gain from a copy);
            # a device's weights go to (pinned) host memory and the device storage is freed
            host = t.data if device.type == "cpu" else _pinned_copy(t.data)
            kept.append((t, host, device))
            t.data = torch.empty(0, dtype=t.dtype, device=device)
        return cls(kept)

    @torch.no_grad()
    def restore(self) -> None:
        for t, host, device in self.tensors:
            t.data = host if device.type == "cpu" else host.to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy (the wake's host-to-device copies run at full bandwidth)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t)
    return host


@dataclass
class SleepReport:
    level: int
    released_bytes: int  # device bytes of the released modules and pools
    components: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "released_bytes": self.released_bytes, "components": list(self.components),
                "seconds": self.seconds}


def loop_components(pipeline: Pipeline) -> set[str]:
    """Components the request loops step (the DiT, the LM, their KV pools): what level 1 drops."""
    return {c for node in pipeline.spec.nodes if node.is_loop and node.stage.progress_steps
            for c in node.stage.components}


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
        self._released: dict[str, _Released] = {}
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
                self._released[name] = _Released.of(module)
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
