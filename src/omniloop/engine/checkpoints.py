"""Crash checkpoints of running loops: when the engine takes them and where they go.

The engine takes a loop's ``LoopCheckpoint`` at a step boundary when the ``CheckpointCadence``
says so (every N steps, or every T seconds of the loop's run) and hands it to a
``LoopCheckpoints`` store, which keeps one per request (the server's durable job store
writes it to disk: ``serve/job_checkpoints.py``). A request resumed after a crash is
submitted like any other; when it reaches the loop a checkpoint belongs to, the engine
``init``s the loop and then ``restore``s the checkpoint into it, so its remaining steps
continue where the dead process stopped. The store forgets a request's checkpoint when
the request ends, however it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from omniloop.pipeline.checkpoint import LoopCheckpoint


@dataclass(frozen=True)
class CheckpointCadence:
    """When a running loop is checkpointed: after ``every_steps`` steps or ``every_s`` seconds
    since its last checkpoint (or its start), whichever comes first (None: that rule is off).
    By seconds, a job shorter than ``every_s`` writes none."""

    every_steps: int | None = None
    every_s: float | None = 30.0

    def __post_init__(self) -> None:
        assert self.every_steps is None or self.every_steps >= 1, f"every_steps must be >= 1, got {self.every_steps}"
        assert self.every_s is None or self.every_s > 0, f"every_s must be > 0, got {self.every_s}"

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    def due(self, steps_since: int, seconds_since: float) -> bool:
        return ((self.every_steps is not None and steps_since >= self.every_steps)
                or (self.every_s is not None and seconds_since >= self.every_s))


class LoopCheckpoints(Protocol):
    """Where an engine's loop checkpoints go (called on the engine's thread)."""

    @property
    def cadence(self) -> CheckpointCadence: ...

    def wants(self, request_id: str) -> bool:
        """Whether the request's loops are checkpointed at all (a server's durable jobs are;
        its sessions, chats and warmup requests are not: nothing would resume them)."""
        ...

    def save(self, request_id: str, checkpoint: LoopCheckpoint) -> None:
        """Keep ``checkpoint`` as the request's latest (replacing the one before)."""
        ...

    def resume_point(self, request_id: str, node: str) -> LoopCheckpoint | None:
        """The checkpoint a resumed request's loop at ``node`` continues from, once (None:
        none; one that cannot be read is reported through ``resumed`` and is None too)."""
        ...

    def resumed(self, request_id: str, node: str, step: int | None, why: str | None) -> None:
        """The request's loop at ``node`` continues from ``step`` (None: from its first step,
        ``why`` says why the checkpoint was not used)."""
        ...

    def discard(self, request_id: str) -> None:
        """The request ended: forget (and delete) its checkpoint."""
        ...
