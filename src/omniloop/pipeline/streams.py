"""Streaming edges: chunks handed from a running loop to the loop that consumes them.

Design note (issue 32 item 1; design §6.2.4, §7(d)). A separable omni graph (thinker →
talker → token2wav) must not wait for a whole text answer before speaking. An edge of the
graph may therefore *stream*:

* **Ports.** A loop stage that can emit chunks lists the port in ``stream_outputs`` (port ->
  chunk type) and returns its chunks in ``StepResult.chunks`` (``(port, chunk)`` pairs, in
  order) from ``step`` / ``step_many``. A loop that can consume chunks lists the port in
  ``stream_inputs`` and reads an :class:`EdgeChannel` through ``ctx.stream(state, port)``
  (at ``init``; it keeps the channel in its ``LoopState``), taking chunks in its steps
  with ``take()`` until ``exhausted``. Stream ports are not ``inputs``/``outputs``: they carry
  chunks, never one whole artifact in ``RequestState.artifacts``. A consumer that needs more
  than one chunk per step (a vocoder's window of codec codes) says so in its ``ready(loop)``
  (``loop.codes.pending >= window or loop.codes.closed``); the engine's rule is one chunk.
* **Declaration.** The family declares which edges stream in its PipelineSpec:
  ``PipelineSpec(..., streams=(StreamEdge("codes", capacity=4),))``. A stream port whose
  edge is *not* declared still works: its channel is unbounded and the consumer starts when
  its producer has finished (the non-streamed baseline: the same stage code, the same chunks,
  the same result). Declaring an edge whose producer or consumer cannot stream (not a loop,
  or the port is not a stream port) is refused at build naming both nodes.
* **The engine owns the rest** (``omniloop.engine.engine``): it opens one channel per stream
  edge of a request at admission, puts each step's chunks on it, closes it when the producer
  finalizes; it starts a consumer of a declared edge as soon as the first chunk is there (a
  *lane* of the request, scheduled like any request so its steps batch with other requests'
  steps at that node); a consumer step is ready only when a chunk is pending or the edge is
  closed (readiness), a producer step only while every declared edge it feeds holds fewer
  than ``capacity`` chunks (backpressure); cancelling the request stops every node of it, and
  a failing node fails its own request only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omniloop.request import Artifact

C = TypeVar("C", bound=Artifact)

DEFAULT_STREAM_CAPACITY = 8  # chunks a producer may run ahead of its consumer


@dataclass(frozen=True)
class StreamEdge:
    """A graph edge declared streaming: its consumer starts at the first chunk, and its
    producer waits while ``capacity`` chunks are pending (a step may add a few past it: the
    bound is checked before each producer step)."""

    edge: str
    capacity: int = DEFAULT_STREAM_CAPACITY

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"StreamEdge({self.edge!r}).capacity={self.capacity}: pass a capacity of at least 1 chunk")


@dataclass(eq=False)
class EdgeChannel(Generic[C]):
    """The chunk queue of one stream edge of one request (runtime-owned, per request).

    ``capacity`` None: the edge is not declared streaming (its consumer starts after the
    producer ended; nothing bounds the queue)."""

    edge: str
    capacity: int | None = None
    closed: bool = False
    produced: int = 0  # chunks put so far
    consumed: int = 0  # chunks taken so far
    _chunks: deque[C] = field(default_factory=deque)

    def put(self, chunk: C) -> None:
        assert not self.closed, f"edge {self.edge!r}: a chunk after its producer finished"
        self._chunks.append(chunk)
        self.produced += 1

    def close(self) -> None:
        """The producer finished: no chunk follows."""
        self.closed = True

    def take(self, limit: int | None = None) -> list[C]:
        """The pending chunks (at most ``limit``), oldest first; [] when none is pending."""
        n = len(self._chunks) if limit is None else min(limit, len(self._chunks))
        out = [self._chunks.popleft() for _ in range(n)]
        self.consumed += n
        return out

    def since(self, produced: int) -> list[C]:
        """The pending chunks put after the first ``produced`` ones (what a mirror of this channel
        in another process has not been sent yet), oldest first; nothing is taken."""
        return list(self._chunks)[max(produced - self.consumed, 0):]

    @property
    def pending(self) -> int:
        return len(self._chunks)

    @property
    def exhausted(self) -> bool:
        """Closed and every chunk taken: the consumer has seen the whole stream."""
        return self.closed and not self._chunks

    @property
    def full(self) -> bool:
        """Backpressure: the producer's next step waits."""
        return self.capacity is not None and len(self._chunks) >= self.capacity

    @property
    def readable(self) -> bool:
        """Readiness: a consumer step has something to do (a chunk, or the end)."""
        return bool(self._chunks) or self.closed
