"""Helpers every benchmark shares: JSON-lines output, timing, and random modules built in place."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch


def emit(record: dict, sink: IO[str] | None = None) -> None:
    """Print ``record`` as one JSON line and, given a sink, append it there (flushed, so a run
    cut short keeps what it measured)."""
    line = json.dumps(record)
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()


@contextlib.contextmanager
def jsonl_sink(path: str | Path | None, mode: str = "a") -> Iterator[IO[str] | None]:
    """The file ``--out`` names, for :func:`emit` to append the JSON lines to (``mode`` "w":
    start it afresh), closed however the run ends; None when no file is named."""
    if not path:
        yield None
        return
    with open(path, mode) as sink:
        yield sink


def fill_unset(args: argparse.Namespace, preset: Mapping[str, Any]) -> argparse.Namespace:
    """``args`` with each of ``preset``'s names set to its value where no flag gave one (the flag's
    default is None): the sizes a benchmark picks for the GPU or ``--tiny``, under the flags the
    user passed. Names no flag declares are set from ``preset`` too."""
    for key, value in preset.items():
        if vars(args).get(key) is None:
            setattr(args, key, value)
    return args


def dims(text: str) -> tuple[int, ...]:
    """An ``HxWxF``-style flag (``480x81``) as a tuple of ints (an argparse ``type``)."""
    return tuple(int(x) for x in text.split("x"))


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


def profile_top(fn: Callable[[], object], *, cuda: bool, steps: int = 2, top: int = 15) -> list[dict]:
    """The ``top`` kernels (CUDA) or ops (CPU) by self time over ``steps`` calls of ``fn``,
    per call: where a step's time goes, to compare two implementations kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm (compiled graphs, cuDNN plans) outside the trace
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if cuda:  # kernels only: a launching op (a Triton kernel's host call, a custom op) also carries
        # its kernel's device time, so counting both listed each kernel twice and halved the shares
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
    total = sum(getattr(e, attr, 0.0) for e in events) / steps / 1e3
    return [{"kernel": e.key[:120], "ms_per_call": round(getattr(e, attr, 0.0) / steps / 1e3, 3),
             "launches_per_call": round(e.count / steps, 2), "share": round(getattr(e, attr, 0.0) / steps / 1e3 / total, 4)}
            for e in rows]


def built_in(device: torch.device, dtype: torch.dtype, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` with its parameters created on ``device`` in ``dtype`` (no fp32 host copy of a
    large random model), in eval mode without gradients."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def agreement(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0) -> dict:
    """PSNR (dB, against ``data_range``: 1 for pixels in [0, 1], 2 for audio in [-1, 1]) and
    max |a - b| of two decoded outputs of the same shape (float64: long clips stay exact)."""
    a, b = a.double().cpu(), b.double().cpu()
    mse = torch.mean((a - b) ** 2).item()
    psnr = float("inf") if mse == 0 else 10 * math.log10(data_range**2 / mse)
    return {"psnr_db": round(psnr, 2), "max_abs_diff": round((a - b).abs().max().item(), 5)}
