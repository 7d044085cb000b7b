"""Adapter cache: the LoRA registry of one deployment, with disk -> host -> device tiers,
an LRU in each tier under a byte budget, and per-request references (design §6.3.2,
weight/adapter cache).

* ``load(name, path)`` reads and checks a LoRA file against the model (a LoRA for another
  model fails here, naming its keys; the deployment keeps serving), wraps the linears it
  targets in ``LoraLinear`` and keeps its tensors in the host tier.
* ``acquire(refs, owner)`` (the engine thread, at a request's first node that applies
  LoRAs) makes each named adapter device-resident and pins it for ``owner``; ``release``
  unpins. Unpinned device copies are evicted least recently used first when a new one
  needs room; host copies likewise (an adapter evicted from both reloads from its file).
  Everything pinned and still no room: the adapter is used anyway (counted ``over_budget``)
  rather than failing the request.
* ``unload(name)`` removes an adapter; one in use by running requests stays until they
  release it (new requests cannot name it).

Adapters never change the shared weights: a request's deltas are applied per row inside
batched forwards (``layers/lora.py``), so requests with different adapter sets share steps.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from omniloop.models.layers.lora import AdapterSet, linear_shapes, wrap_linears
from omniloop.models.lora import LoraAdapter, LoraSupport, parse_lora
from omniloop.request import InvalidRequest

CACHE_NAME = "adapters"  # Pipeline.caches key


@dataclass
class _Entry:
    name: str
    source: str
    nbytes: int
    components: tuple[str, ...]
    host: LoraAdapter | None = None
    device: LoraAdapter | None = None
    refs: dict[str, int] = field(default_factory=dict)
    unloading: bool = False


@dataclass
class AdapterStats:
    device_hits: int = 0  # acquired while device-resident
    host_loads: int = 0  # host -> device copies
    disk_loads: int = 0  # file reads (registration and reloads)
    device_evictions: int = 0
    host_evictions: int = 0
    over_budget: int = 0  # device copies made with every other copy pinned


class AdapterCache:
    def __init__(self, components: Mapping[str, nn.Module], support: LoraSupport, *, device: torch.device,
                 dtype: torch.dtype, device_budget_bytes: int, host_budget_bytes: int) -> None:
        self.components = dict(components)  # the modules adapters patch, by component name
        self.support = support
        self.device, self.dtype = torch.device(device), dtype
        self.device_budget, self.host_budget = int(device_budget_bytes), int(host_budget_bytes)
        self.stats = AdapterStats()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # registration order; LRU order below
        self._device_lru: OrderedDict[str, None] = OrderedDict()
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.RLock()
        self.on_drop: Callable[[str, str], None] | None = None  # (name, source file) once no request holds it

    # -- registry -------------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> dict[str, Any]:
        """Register ``path`` as ``name`` (replacing nothing: unload first). Bad files raise
        ValueError naming what does not match; the registry is then unchanged."""
        with self._lock:
            if name in self._entries and not self._entries[name].unloading:
                raise ValueError(f"a LoRA named {name!r} is already loaded; unload it first or pick another name")
        linears = {c: linear_shapes(m) for c, m in self.components.items() if c in self.support.components}
        adapter = parse_lora(name, path, self.support, linears)  # outside the lock: reads the file
        for component, layers in adapter.layers.items():
            if layers:
                streams = (self.support.streams or {}).get(component)
                wrap_linears(self.components[component], sorted(layers), streams)
        with self._lock:
            self.stats.disk_loads += 1
            entry = _Entry(name, str(path), adapter.nbytes, adapter.components, host=adapter)
            self._entries[name] = entry
            self._touch(self._host_lru, name)
            self._fit_host()
            return self._info(entry)

    def unload(self, name: str) -> None:
        with self._lock:
            entry = self._entry(name)
            if entry.refs:
                entry.unloading = True  # running requests keep it until they release
                return
            self._drop(name)

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, e in self._entries.items() if not e.unloading]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries and not self._entries[name].unloading

    def check(self, refs: Sequence[Any], field_name: str = "diffusion.loras") -> None:
        """Admission: every named adapter is registered (else ValueError naming it)."""
        with self._lock:
            for i, ref in enumerate(refs):
                if ref.name not in self:
                    raise InvalidRequest(f"{field_name}[{i}].name {ref.name!r} is not a loaded LoRA; loaded: "
                                         f"{self.names()} (load it first: POST /v1/loras, or deploy config loras)",
                                         fields=(f"{field_name}[{i}].name",))

    def signature(self, refs: Sequence[Any], component: str) -> str:
        """The adapter-set key of ``refs`` restricted to the adapters that patch ``component``
        ("" when none does): what the text-embedding cache partitions by."""
        with self._lock:
            parts = [f"{r.name}@{r.strength!r}" for r in refs if component in self._entry(r.name).components]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16] if parts else ""

    # -- use --------------------------------------------------------------------------------
    def acquire(self, refs: Sequence[Any], owner: str) -> dict[str, AdapterSet]:
        """Device copies of ``refs``' adapters, pinned for ``owner``: component -> the set to
        apply (adapter layers, strength) in request order."""
        out: dict[str, list] = {}
        with self._lock:
            for ref in refs:
                entry = self._entry(ref.name)
                if entry.unloading:
                    raise InvalidRequest(f"LoRA {ref.name!r} was unloaded", hint="load it again to use it",
                                         fields=("diffusion.loras",))
                device = self._device_copy(entry)
                entry.refs[owner] = entry.refs.get(owner, 0) + 1
                for component, layers in device.layers.items():
                    if layers:
                        out.setdefault(component, []).append((layers, float(ref.strength)))
        return {c: tuple(s) for c, s in out.items()}

    def release(self, names: Sequence[str], owner: str) -> None:
        with self._lock:
            for name in names:
                entry = self._entries.get(name)
                if entry is None or owner not in entry.refs:
                    continue
                entry.refs[owner] -= 1
                if entry.refs[owner] <= 0:
                    del entry.refs[owner]
                if not entry.refs and entry.unloading:
                    self._drop(name)
            self._fit_device()

    def drop_device_copies(self) -> None:
        """The model moved off the device: forget every device copy (none may be pinned)."""
        with self._lock:
            for name in list(self._device_lru):
                assert not self._entries[name].refs, f"LoRA {name!r} is in use; a busy model is never moved"
                self._entries[name].device = None
            self._device_lru.clear()

    # -- tiers ------------------------------------------------------------------------------
    def _device_copy(self, entry: _Entry) -> LoraAdapter:
        if entry.device is not None:
            self.stats.device_hits += 1
            self._touch(self._device_lru, entry.name)
            return entry.device
        if entry.host is None:  # evicted from the host tier: read the file again
            linears = {c: linear_shapes(m) for c, m in self.components.items() if c in self.support.components}
            entry.host = parse_lora(entry.name, entry.source, self.support, linears)
            self.stats.disk_loads += 1
            self._touch(self._host_lru, entry.name)
            self._fit_host(keep=entry.name)
        self.stats.host_loads += 1
        self._fit_device(room_for=entry.nbytes)
        if self._bytes("device") + entry.nbytes > self.device_budget:
            self.stats.over_budget += 1
        entry.device = entry.host.to(self.device, self.dtype)
        self._touch(self._device_lru, entry.name)
        return entry.device

    def _fit_device(self, room_for: int = 0) -> None:
        for name in list(self._device_lru):
            if self._bytes("device") + room_for <= self.device_budget:
                return
            entry = self._entries[name]
            if entry.refs:
                continue
            entry.device = None
            del self._device_lru[name]
            self.stats.device_evictions += 1

    def _fit_host(self, keep: str | None = None) -> None:
        for name in list(self._host_lru):
            if self._bytes("host") <= self.host_budget:
                return
            if name == keep:
                continue
            self._entries[name].host = None
            del self._host_lru[name]
            self.stats.host_evictions += 1

    def _bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._entries.values() if getattr(e, tier) is not None)

    @staticmethod
    def _touch(lru: OrderedDict[str, None], name: str) -> None:
        lru[name] = None
        lru.move_to_end(name)

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        self._device_lru.pop(name, None)
        self._host_lru.pop(name, None)
        if entry is not None and self.on_drop is not None:
            self.on_drop(name, entry.source)

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {self.names()}")
        return entry

    # -- reporting --------------------------------------------------------------------------
    def _info(self, entry: _Entry) -> dict[str, Any]:
        return {"name": entry.name, "source": entry.source, "bytes": entry.nbytes, "components": list(entry.components),
                "device_resident": entry.device is not None, "host_resident": entry.host is not None,
                "in_use": sum(entry.refs.values())}

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._info(e) for e in self._entries.values() if not e.unloading]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            return {"loaded": len(self.names()), "device_bytes": self._bytes("device"), "host_bytes": self._bytes("host"),
                    "device_budget_bytes": self.device_budget, "host_budget_bytes": self.host_budget,
                    "device_hits": s.device_hits, "host_loads": s.host_loads, "disk_loads": s.disk_loads,
                    "device_evictions": s.device_evictions, "host_evictions": s.host_evictions,
                    "over_budget": s.over_budget}
