"""Profiler: per node / step / block wall times; on CUDA also CUDA-event times, NVTX
ranges and the memory watermark. Exported through the engine's metrics
(``Engine.plugin_metrics()`` / ``AsyncEngine.stats()["plugins"]``).

Wall times are host times: on GPU a block's wall time is its launch time, the CUDA-event
time is its device time. CUDA events are resolved lazily (when metrics are read), so the
profiler adds no host-device sync to the step. Batched steps: every loop in a
``step_many`` call is charged the batch's step time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from omniloop.ext.hooks import NodeEvent, Observer, RequestEvent, StepEvent, TapEvent
from omniloop.ext.plugin import Declarations, PluginConfig

BLOCK_TAPS = r"(transformer|transformer_2)\.blocks\.\d+"
MAX_PENDING_EVENTS = 20000


class ProfilerConfig(PluginConfig):
    blocks: bool = Field(default=True, description="time every transformer block (taps; de-compiles compiled blocks)")
    block_taps: str = Field(default=BLOCK_TAPS, description="regex of the modules timed as blocks")
    nvtx: bool = Field(default=True, description="NVTX ranges per step and block (CUDA only)")
    cuda_events: bool = Field(default=True, description="CUDA-event device times per step and block (CUDA only)")


@dataclass
class Timing:
    count: int = 0
    total: float = 0.0
    max: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def summary(self) -> dict[str, float]:
        return {"count": self.count, "total_s": round(self.total, 6),
                "mean_s": round(self.total / self.count, 6) if self.count else 0.0, "max_s": round(self.max, 6)}


class Profiler(Observer):
    def __init__(self, name: str, config: ProfilerConfig, device: torch.device | str = "cpu") -> None:
        self.name = name
        self.config = config
        self.taps = config.block_taps if config.blocks else None
        self.declarations = Declarations(kind="observer", needs_eager=config.blocks)
        self.cuda = torch.device(device).type == "cuda"
        self.nvtx = self.cuda and config.nvtx and _nvtx_available()
        self.nodes: dict[str, Timing] = {}
        self.steps: dict[str, Timing] = {}
        self.blocks: dict[str, Timing] = {}
        self.cuda_steps: dict[str, Timing] = {}
        self.cuda_blocks: dict[str, Timing] = {}
        self._open: dict[tuple, float] = {}  # (kind, key...) -> start time
        self._ranges: dict[tuple, int] = {}  # open NVTX ranges
        self._events: dict[tuple, Any] = {}  # open CUDA start events
        self._pending: deque[tuple[dict[str, Timing], str, Any, Any]] = deque(maxlen=MAX_PENDING_EVENTS)
        self.peak_memory_bytes = 0

    # -- nodes and steps ---------------------------------------------------------------------
    def node_start(self, event: NodeEvent) -> None:
        self._open[("node", event.request_id, event.node)] = time.perf_counter()

    def node_end(self, event: NodeEvent) -> None:
        t0 = self._open.pop(("node", event.request_id, event.node), None)
        if t0 is not None:
            self.nodes.setdefault(event.node, Timing()).add(time.perf_counter() - t0)

    def step_start(self, event: StepEvent) -> None:
        key = ("step", event.request_id, event.node)
        self._open[key] = time.perf_counter()
        self._begin_device(key, f"{event.node} step {event.step} {event.request_id}")

    def step_end(self, event: StepEvent) -> None:
        key = ("step", event.request_id, event.node)
        t0 = self._open.pop(key, None)
        if t0 is not None:
            self.steps.setdefault(event.node, Timing()).add(time.perf_counter() - t0)
        self._end_device(key, self.cuda_steps, event.node)
        if self.cuda:
            self.peak_memory_bytes = max(self.peak_memory_bytes, int(torch.cuda.max_memory_allocated()))

    def request_end(self, event: RequestEvent) -> None:
        """A request that failed or was cancelled mid-node leaves spans open: drop them."""
        for key in [k for k in self._open if len(k) == 3 and k[1] == event.request_id]:
            self._open.pop(key)
            self._end_device(key, {}, "")

    # -- blocks ----------------------------------------------------------------------------------
    def module_pre(self, event: TapEvent) -> None:
        key = ("block", event.module)
        self._open[key] = time.perf_counter()
        self._begin_device(key, event.module)

    def module_post(self, event: TapEvent) -> None:
        key = ("block", event.module)
        t0 = self._open.pop(key, None)
        if t0 is not None:
            self.blocks.setdefault(event.module, Timing()).add(time.perf_counter() - t0)
        self._end_device(key, self.cuda_blocks, event.module)

    # -- device timing -----------------------------------------------------------------------------
    def _begin_device(self, key: tuple, label: str) -> None:
        if not self.cuda:
            return
        if self.nvtx:
            self._ranges[key] = torch.cuda.nvtx.range_start(label)
        if self.config.cuda_events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events[key] = start

    def _end_device(self, key: tuple, table: dict[str, Timing], label: str) -> None:
        if not self.cuda:
            return
        rid = self._ranges.pop(key, None)
        if rid is not None:
            torch.cuda.nvtx.range_end(rid)
        start = self._events.pop(key, None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((table, label, start, end))

    def _resolve(self) -> None:
        while self._pending and self._pending[0][3].query():
            table, label, start, end = self._pending.popleft()
            table.setdefault(label, Timing()).add(start.elapsed_time(end) / 1000.0)

    def metrics(self) -> dict[str, Any]:
        self._resolve()
        # list(...) snapshots in C: metrics are read from other threads (AsyncEngine.stats)
        out: dict[str, Any] = {
            "node_s": {k: v.summary() for k, v in list(self.nodes.items())},
            "step_s": {k: v.summary() for k, v in list(self.steps.items())},
            "block_s": {k: v.summary() for k, v in list(self.blocks.items())},
        }
        if self.cuda:
            out["cuda_step_s"] = {k: v.summary() for k, v in list(self.cuda_steps.items())}
            out["cuda_block_s"] = {k: v.summary() for k, v in list(self.cuda_blocks.items())}
            out["peak_memory_bytes"] = self.peak_memory_bytes
        return out


def _nvtx_available() -> bool:
    try:
        torch.cuda.nvtx.range_end(torch.cuda.nvtx.range_start("omniloop.profiler.probe"))
        return True
    except Exception:  # a torch build without NVTX: device times still come from CUDA events
        return False
