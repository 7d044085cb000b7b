"""How the engine measures a step without stalling the device.

The cost model calibrates from measured step times, and request metrics report them. On
a GPU the honest measurement is the device's own: a CUDA event before and after the step,
read once the GPU has passed the second one (``Event.query()``), so the host never waits
for it (a ``torch.cuda.synchronize`` per step would drain the launch queue every step and
serialize host and device work). The cost model then learns a step's time a step or two
later, which is all it needs. Nothing waits except ``collect(wait=True)``, which the engine
calls when a request ends (its metrics must be complete) — once per request, not per step.

On the CPU the wall clock is the step's time and is delivered at once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Protocol

import torch

OnElapsed = Callable[[float], None]  # receives a step's measured seconds


class StepTimer(Protocol):
    def start(self) -> Any:
        """A mark taken just before the step's work is issued."""
        ...

    def stop(self, mark: Any, on_elapsed: OnElapsed) -> None:
        """The step's work has been issued: deliver its seconds to ``on_elapsed`` (now, or
        from a later ``collect``)."""
        ...

    def collect(self, *, wait: bool = False) -> None:
        """Deliver the measurements that are ready (``wait``: all of them)."""
        ...


class WallTimer:
    """Host wall clock, delivered at once (CPU devices: the work is done when the call returns)."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float, on_elapsed: OnElapsed) -> None:
        on_elapsed(time.perf_counter() - mark)

    def collect(self, *, wait: bool = False) -> None:
        pass


class CudaEventTimer:
    """A CUDA event pair per step on the device's current stream, read lazily (no sync).

    ``event`` / ``stream`` build the events and pick the stream to record on (defaults:
    timing-enabled ``torch.cuda.Event``, the device's current stream); tests pass fakes."""

    def __init__(self, device: torch.device, *, event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None) -> None:
        self.device = device
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: torch.cuda.current_stream(device))
        self._pending: deque[tuple[Any, Any, OnElapsed]] = deque()

    def start(self) -> Any:
        mark = self._event()
        mark.record(self._stream())
        return mark

    def stop(self, mark: Any, on_elapsed: OnElapsed) -> None:
        end = self._event()
        end.record(self._stream())
        self._pending.append((mark, end, on_elapsed))

    def collect(self, *, wait: bool = False) -> None:
        while self._pending:
            start, end, on_elapsed = self._pending[0]
            if not end.query():  # the GPU has not got there yet
                if not wait:
                    return
                end.synchronize()  # this event only, not the device
            self._pending.popleft()
            on_elapsed(start.elapsed_time(end) / 1000.0)  # ms -> s

    @property
    def pending(self) -> int:
        return len(self._pending)


def step_timer_for(device: torch.device) -> StepTimer:
    return CudaEventTimer(device) if device.type == "cuda" else WallTimer()
