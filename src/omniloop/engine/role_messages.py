"""What crosses between the engine (rank 0) and a role pool's worker (engine/role_pool.py):
one :class:`NodeCall` per node operation the scheduler decided, one :class:`CallReply`
back. Artifacts never travel in these messages themselves: they are a connector's
``Packed`` handles (engine/connectors.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal

from omniloop.engine.connectors import Packed, TransferMetric
from omniloop.request import OmniRequest

Op = Literal["forward", "forward_many", "init", "step", "feed", "finalize", "release", "forget"]


@dataclass(frozen=True)
class CallItem:
    """One request of a call: the request itself the first time the pool sees it, and the
    node's input artifacts (``forward``, ``init``)."""

    request_id: str
    request: OmniRequest | None = None
    inputs: Packed | None = None
    # a stream consumer's new chunks ({edge: [chunk, ...]}, through the connector) and the edges
    # whose producer has finished since the last call: the pool's channels mirror rank 0's
    chunks: Packed | None = None
    closed: tuple[str, ...] = ()
    # other pools' outputs rank 0 forwards as their connector's handles (``borrowed``: this pool
    # copies out and leaves the segments, rank 0 frees them after their last reader)
    forwarded: tuple[Packed, ...] = ()


@dataclass(frozen=True)
class NodeCall:
    op: Op
    node: str
    items: tuple[CallItem, ...]


@dataclass(frozen=True)
class LoopView:
    """What rank 0's scheduler reads of a loop whose state lives on a pool (refreshed by every call)."""

    steps_done: int
    steps_target: int
    batch_key: Hashable | None
    batch_weight: int
    step_flops: float | None
    ready: bool
    ready_at: float | None
    in_prologue: bool
    finite: bool = True
    consumed: tuple[tuple[str, int], ...] = ()  # stream input edge -> chunks the loop has taken so far


@dataclass(frozen=True)
class ItemResult:
    """One request's outcome of a call; ``error``: its failure (``"Type: message"``), the rest unset."""

    error: str | None = None
    view: LoopView | None = None  # init, step, feed
    done: bool = False  # step
    outputs: Packed | None = None  # forward, finalize: the edges the node wrote
    emitted: Packed | None = None  # step: {"emit": [(name, artifact)], "chunks": [(port, chunk)]}


@dataclass(frozen=True)
class CallReply:
    results: tuple[ItemResult, ...]
    received: tuple[TransferMetric, ...] = ()  # the transfers the worker unpacked for this call


@dataclass(frozen=True)
class PoolReady:
    pool: str


@dataclass(frozen=True)
class PoolFailed:
    """The worker could not start or go on; it exits after sending this."""

    pool: str
    error: str
