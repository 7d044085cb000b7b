"""Connectors: how edge artifacts cross from one pool to another (design §6.3.4).

A ``Connector`` moves the artifacts of one transfer (a request's edges, for one node call)
from a sender to a receiver. The sender ``pack``s them into a small picklable handle that
travels on the pools' control pipe; the receiver's ``unpack`` is the readiness signal (it
returns when every byte is there) and gives the artifacts on the receiver's device. Each
transfer is measured (:class:`TransferMetric`: bytes, seconds from ``pack`` to the end of
``unpack``; ``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process of a host).

Implemented: :class:`InProcessConnector` (the artifacts themselves: zero copies, for nodes
in one process) and :class:`SharedMemoryConnector` (every tensor in a POSIX shared-memory
segment the receiver maps, copies out of and unlinks; everything else pickled). A handle
marked ``borrowed`` (a pool-to-pool transfer rank 0 forwards, engine/held_artifacts.py) is
copied out of and left in place: rank 0 owns its segments and ``discard``s them once, after
their last reader. Named
extension points: ``"nccl"`` (device-to-device over a process group) and ``"nixl"``
(NIXL / Mooncake-style transfer engines) — the same two calls; refused until implemented.
"""

from __future__ import annotations

import io
import pickle
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Mapping, Protocol

import torch


CONNECTORS = ("in_process", "shared_memory")
EXTENSION_POINTS = ("nccl", "nixl")


@dataclass(frozen=True)
class TransferMetric:
    """One transfer: what moved (edges), where, how many tensor bytes, and how long it took."""

    request_id: str
    edges: tuple[str, ...]
    source: str  # pool name ("main": the engine's process)
    target: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Packed:
    """What crosses the control channel for one transfer (a connector's handle)."""

    request_id: str
    source: str
    payload: Any  # the connector's: the artifacts (in-process) or pickled bytes + segment refs
    bytes: int
    started: float  # perf_counter at pack
    segments: tuple[str, ...] = ()  # shared-memory segments the receiver unlinks (``discard`` if it never does)
    edges: tuple[str, ...] = ()  # the keys of what was packed (a node's output edges)
    # True: a forwarded handle whose segments another process owns (rank 0, for a pool-to-pool
    # transfer); the receiver copies out and leaves them mapped for the next reader
    borrowed: bool = False


class Connector(Protocol):
    name: str

    def pack(self, request_id: str, source: str, artifacts: Mapping[str, Any]) -> Packed:
        """Sender side: the artifacts of one transfer (edge -> artifact, or any picklable value
        holding artifacts and tensors), made ready to cross."""
        ...

    def unpack(self, packed: Packed, target: str, device: torch.device) -> tuple[dict[str, Any], TransferMetric]:
        """Receiver side: the artifacts on ``device`` once they are all there (readiness), and the transfer's metric."""
        ...


class InProcessConnector:
    """Sender and receiver share the process: the artifacts are handed over by reference."""

    name = "in_process"

    def pack(self, request_id: str, source: str, artifacts: Mapping[str, Any]) -> Packed:
        return Packed(request_id, source, dict(artifacts), 0, time.perf_counter(), edges=tuple(artifacts))

    def unpack(self, packed: Packed, target: str, device: torch.device) -> tuple[dict[str, Any], TransferMetric]:
        arts: dict[str, Any] = packed.payload
        metric = TransferMetric(packed.request_id, tuple(arts), packed.source, target, 0,
                                time.perf_counter() - packed.started)
        return arts, metric


@dataclass(frozen=True)
class _SegmentRef:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class _Pickler(pickle.Pickler):
    """Pickles an artifact with every tensor moved into a shared-memory segment of its own."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.segments: list[shared_memory.SharedMemory] = []
        self.bytes = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        # the receiver unlinks it: this process's resource tracker must not (Python 3.11 has no track=False)
        resource_tracker.unregister(f"/{segment.name}", "shared_memory")  # POSIX names carry a leading slash
        if nbytes:
            dst = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
            dst.copy_(flat.view(torch.uint8))
            del dst  # no export of the buffer may outlive this call (close() refuses then)
        self.segments.append(segment)
        self.bytes += nbytes
        return _SegmentRef(segment.name, obj.dtype, tuple(obj.shape), nbytes)


class _Unpickler(pickle.Unpickler):
    def __init__(self, buffer: io.BytesIO, device: torch.device, unlink: bool = True) -> None:
        super().__init__(buffer)
        self.device = device
        self.unlink = unlink

    def persistent_load(self, ref: Any) -> Any:
        assert isinstance(ref, _SegmentRef), f"unknown persistent id {ref!r}"
        segment = shared_memory.SharedMemory(name=ref.name)
        try:
            if ref.nbytes:
                raw = torch.frombuffer(segment.buf, dtype=torch.uint8, count=ref.nbytes).clone()
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            tensor = raw.view(ref.dtype).reshape(ref.shape)
        finally:
            segment.close()
            if self.unlink:
                segment.unlink()  # the receiver owns the segment once it has read it (unless borrowed)
        return tensor.to(self.device)


@dataclass
class SharedMemoryConnector:
    """Tensors through POSIX shared memory (one segment per tensor; the receiver unlinks),
    the rest of the artifact pickled: two host copies, no socket bytes for the payload."""

    name: str = "shared_memory"

    def pack(self, request_id: str, source: str, artifacts: Mapping[str, Any]) -> Packed:
        started = time.perf_counter()
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(dict(artifacts))
        for segment in pickler.segments:
            segment.close()  # this side's mapping; the segment lives until the receiver unlinks it
        return Packed(request_id, source, buffer.getvalue(), pickler.bytes, started,
                      tuple(seg.name for seg in pickler.segments), edges=tuple(artifacts))

    def unpack(self, packed: Packed, target: str, device: torch.device) -> tuple[dict[str, Any], TransferMetric]:
        arts: dict[str, Any] = _Unpickler(io.BytesIO(packed.payload), torch.device(device),
                                          unlink=not packed.borrowed).load()
        metric = TransferMetric(packed.request_id, tuple(arts), packed.source, target, packed.bytes,
                                time.perf_counter() - packed.started)
        return arts, metric


def connector_for(name: str) -> Connector:
    """The connector a pool declares (``PoolSpec.connector``)."""
    if name == "in_process":
        return InProcessConnector()
    if name == "shared_memory":
        return SharedMemoryConnector()
    if name in EXTENSION_POINTS:
        raise ValueError(f"connector {name!r} is a named extension point, not implemented in this build; "
                         f"pass one of {list(CONNECTORS)}")
    raise ValueError(f"unknown connector {name!r}; pass one of {list(CONNECTORS)} (extension points: {list(EXTENSION_POINTS)})")


def discard(packed: Packed) -> None:
    """Free the segments of a transfer whose receiver never read it (it died)."""
    for name in packed.segments:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue  # read and unlinked already
        segment.close()
        segment.unlink()
