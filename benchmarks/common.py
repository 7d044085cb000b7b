"""Helpers every benchmark shares: JSON-lines output and timing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import IO

import torch


def emit(record: dict, sink: IO[str] | None = None) -> None:
    """Print ``record`` as one JSON line and, given a sink, append it there (flushed, so a run
    cut short keeps what it measured)."""
    line = json.dumps(record)
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()


def timed(fn: Callable[[], object], *, warmup: int, iters: int, cuda: bool) -> list[float]:
    """Seconds of each of ``iters`` calls after ``warmup`` untimed ones: CUDA events on the
    GPU, wall time on the CPU."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times
