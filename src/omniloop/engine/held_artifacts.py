"""Pool-to-pool transfers: rank 0 holds a placed node's outputs as the connector's handle
(engine/role_pool.py, design §6.3.4).

When a node on pool A writes edges, rank 0 receives the connector's ``Packed`` handle (for
shared memory: the pickled skeleton and the segment names) and does not unpack it. It keeps
the handle in the request's artifact table (:class:`HeldArtifacts`, which replaces
``RequestState.artifacts`` at the request's first placed output):

* a consumer placed on pool B (same connector) is sent the handle itself, marked
  ``borrowed``: B copies the tensors out of the segments and leaves them; the transfer's
  metric is (A, B) and rank 0 moved zero bytes;
* rank 0 materializes the edges lazily, the first time anything on rank 0 reads them (a node
  of the engine's own process, a consumer on a pool with another connector, the final output);
* the segments are freed exactly once (``Held.free``): when the last of its readers (the
  consumer nodes placed on pools, and "main" if rank 0 needs it) has read it, or when the
  request ends whatever the ending (the engine clears the table: completed, failed,
  cancelled, or a pool that died mid-request).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar, overload

from omniloop.engine.connectors import Packed, discard
from omniloop.request.artifacts import Artifact

MAIN = "main"  # the engine's own process, as a reader or a transfer's end


@dataclasses.dataclass(eq=False)
class Held:
    """One handle rank 0 holds: a node's output edges, still in the source pool's connector."""

    packed: Packed
    node: str  # the node that wrote the edges
    connector: str  # the source pool's connector's name (a reader on another connector gets rank 0's copy)
    readers: set[str]  # consumer nodes on pools still to read it, and MAIN while rank 0 has not
    materialize: Callable[[Packed], dict[str, Any]]  # the source pool's unpack onto rank 0's device (metered)
    freed: bool = False

    def forwarded(self) -> Packed:
        """The handle as a consumer pool receives it: it copies out and leaves the segments."""
        return dataclasses.replace(self.packed, borrowed=True)

    def free(self) -> None:
        """Unlink the segments: once, whoever asks first."""
        if not self.freed:
            self.freed = True
            discard(self.packed)


class _Pending:
    def __repr__(self) -> str:
        return "<held by a connector>"


_PENDING: Any = _Pending()
_T = TypeVar("_T")  # the value of an edge rank 0 has not materialized


class HeldArtifacts(dict[str, Artifact]):
    """A request's artifacts (edge -> artifact) where some edges are still connector handles.

    Reading an edge (``[]``, ``get``) materializes its handle on rank 0 (what rank 0 reads of a
    request's artifacts: ``Pipeline.collect_output``, a stage's ``state.get``); ``in`` does not.
    Rank 0 reads edges by name: ``items()`` / ``values()`` would show a held edge unread.
    ``clear`` (the request ended, whatever the ending) frees every live handle."""

    def __init__(self, initial: dict[str, Artifact] | None = None) -> None:
        super().__init__(initial or {})
        self._handles: dict[str, Held] = {}  # edge -> its live handle (materialized here or not)

    # -- the pool-to-pool side ---------------------------------------------------------------
    def hold(self, held: Held) -> None:
        for edge in held.packed.edges:
            self._drop(edge)
            super().__setitem__(edge, _PENDING)
            self._handles[edge] = held
        if not held.readers - {MAIN}:  # no pool reads it: rank 0's copy now, as before
            self._materialize(held)

    def handle(self, edge: str) -> Held | None:
        """The live handle of ``edge`` (a consumer pool may be sent it), None when rank 0 holds the artifact only."""
        held = self._handles.get(edge)
        return held if held is not None and not held.freed else None

    def read_by(self, held: Held, reader: str) -> None:
        """``reader`` has read the handle; the last reader frees it."""
        held.readers.discard(reader)
        if not held.readers:
            self._free(held)

    # -- the dict, materializing on read -----------------------------------------------------
    def __getitem__(self, edge: str) -> Artifact:
        value = super().__getitem__(edge)
        if value is _PENDING:
            self._materialize(self._handles[edge])
            value = super().__getitem__(edge)
        return value

    @overload
    def get(self, edge: str, default: None = None, /) -> Artifact | None: ...
    @overload
    def get(self, edge: str, default: Artifact, /) -> Artifact: ...
    @overload
    def get(self, edge: str, default: _T, /) -> Artifact | _T: ...
    def get(self, edge: str, default: Any = None, /) -> Any:
        return self[edge] if edge in self else default

    def __setitem__(self, edge: str, artifact: Artifact) -> None:
        self._drop(edge)
        super().__setitem__(edge, artifact)

    def clear(self) -> None:
        for held in {id(h): h for h in self._handles.values()}.values():
            held.free()
        self._handles.clear()
        super().clear()

    # -- internals ---------------------------------------------------------------------------
    def _materialize(self, held: Held) -> None:
        """Rank 0's copy of the handle's edges (the segments stay for the pools still to read them)."""
        assert not held.freed, f"edges {held.packed.edges} of node {held.node!r}: handle freed before rank 0 read it"
        for edge, art in held.materialize(held.forwarded()).items():
            if self._handles.get(edge) is held and super().__getitem__(edge) is _PENDING:
                art.node = held.node
                super().__setitem__(edge, art)
        self.read_by(held, MAIN)

    def _free(self, held: Held) -> None:
        held.free()
        for edge in [e for e, h in self._handles.items() if h is held]:
            del self._handles[edge]
            if super().__getitem__(edge) is _PENDING:  # nobody left to read it
                super().pop(edge)

    def _drop(self, edge: str) -> None:
        """``edge`` is overwritten: its old handle loses this edge (and is freed if it held no other)."""
        held = self._handles.pop(edge, None)
        if held is not None and held not in self._handles.values():
            held.free()


__all__ = ["Held", "HeldArtifacts", "MAIN"]
