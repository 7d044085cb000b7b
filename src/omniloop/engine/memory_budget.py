"""The memory budget of admission: a bounded queue and a budget that knows steps are batched.

Every request carries a ``MemoryEstimate`` built at submission from its nodes'
``WorkEstimate``s:

* held bytes: state kept from start to finish (latents, embeddings, history) plus what a
  loop holds only while it runs (an AR loop's KV cache: ``max_tokens`` x bytes per token,
  released when the loop ends, early on EOS/stop);
* one step's activations, per batch group: a batched step of ``max_batch`` requests of one
  group (same node, same shapes) runs all their rows at once, so its peak is the sum of
  their per-request peaks (each already counts its CFG branches when they are stacked);
* the activations of work that never batches (a loop's ``init``, e.g. an AR prefill);
* bytes in cache pools with budgets of their own (the chunk-KV slabs of a causal video
  rollout, ``WorkEstimate.pool_bytes``): each pool's budget is carved out of device memory at
  start, so those bytes are charged against the pool, not the general budget.

The pool admits a request to run only while the running requests' held bytes plus the
worst single step any of them (the candidate included) can form stay within the budget;
a request that cannot fit even alone is refused at submission. "No room" is a return value
(``can_start``), not an exception (STYLE.md 5).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Hashable, Iterable, Mapping

import torch

from omniloop.pipeline.stage import WorkEstimate


@dataclass(frozen=True)
class MemoryEstimate:
    resident_bytes: int = 0  # held from start to finish
    loop_bytes: Mapping[str, int] = field(default_factory=dict)  # node -> held until that node's loop ends
    peaks: Mapping[Hashable, int] = field(default_factory=dict)  # batch group -> one step's activations, this request
    solo_peak_bytes: int = 0  # activations of work that never batches (loop init, e.g. an AR prefill)
    pool_bytes: Mapping[str, int] = field(default_factory=dict)  # cache pool -> bytes it holds for this request

    @classmethod
    def of_nodes(cls, estimates: Mapping[str, WorkEstimate]) -> "MemoryEstimate":
        """A request's estimate from its nodes' (node name -> WorkEstimate)."""
        loops = {node: e.loop_bytes for node, e in estimates.items() if e.loop_bytes}
        # steps stack only with steps of an equal predicted key (stage.batches_with): None runs alone
        peaks: dict[Hashable, int] = {(node, e.batch_group): e.peak_bytes for node, e in estimates.items()
                 if e.peak_bytes and e.batch_group is not None}
        solo = max([*(e.init_peak_bytes for e in estimates.values()),
                    *(e.peak_bytes for e in estimates.values() if e.batch_group is None)], default=0)
        pools: dict[str, int] = {}
        for e in estimates.values():
            for pool, n in e.pool_bytes.items():
                pools[pool] = pools.get(pool, 0) + n
        return cls(sum(e.resident_bytes for e in estimates.values()), loops, peaks, solo, pools)

    @property
    def held_bytes(self) -> int:
        return self.resident_bytes + sum(self.loop_bytes.values())

    @property
    def peak_bytes(self) -> int:
        """The largest transient this request needs alone."""
        return max([self.solo_peak_bytes, *self.peaks.values()])

    @property
    def alone_bytes(self) -> int:
        return self.held_bytes + self.peak_bytes

    def without_loop(self, node: str) -> "MemoryEstimate":
        return replace(self, loop_bytes={n: b for n, b in self.loop_bytes.items() if n != node})


def step_peak_bytes(estimates: Iterable[MemoryEstimate], max_batch: int) -> int:
    """The largest transient of any one work item these requests can form: per batch group,
    the ``max_batch`` largest per-request peaks together; or one request's unbatched work."""
    groups: dict[Hashable, list[int]] = {}
    solo = 0
    for est in estimates:
        solo = max(solo, est.solo_peak_bytes)
        for group, peak in est.peaks.items():
            groups.setdefault(group, []).append(peak)
    batched = (sum(heapq.nlargest(max_batch, peaks)) for peaks in groups.values())
    return max(solo, max(batched, default=0))


def default_memory_budget(device: torch.device) -> int:
    """Free device memory after weights are resident (90%), or half the host's available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    return 8 << 30


@dataclass
class MemoryBudget:
    budget_bytes: int
    max_batch: int = 1  # requests one batched step may hold (SchedulingPolicy.max_batch)
    pool_budgets: Mapping[str, int] = field(default_factory=dict)  # cache pool -> its own budget
    _running: dict[str, MemoryEstimate] = field(default_factory=dict)

    def fits_alone(self, est: MemoryEstimate) -> bool:
        return est.alone_bytes <= self.budget_bytes and not self.pools_short(est, alone=True)

    def pools_short(self, est: MemoryEstimate, *, alone: bool = False) -> dict[str, tuple[int, int]]:
        """Pools ``est`` would overdraw (alone, or with the running requests): pool -> (need, budget)."""
        short = {}
        for pool, n in est.pool_bytes.items():
            budget = self.pool_budgets.get(pool)
            if budget is None:
                continue
            need = n if alone else n + sum(e.pool_bytes.get(pool, 0) for e in self._running.values())
            if need > budget:
                short[pool] = (need, budget)
        return short

    def need_with_running(self, est: MemoryEstimate) -> int:
        """Bytes the running requests and ``est`` would need at their worst step."""
        running = list(self._running.values())
        held = sum(e.held_bytes for e in running) + est.held_bytes
        return held + step_peak_bytes([*running, est], self.max_batch)

    def can_start(self, est: MemoryEstimate) -> bool:
        return self.need_with_running(est) <= self.budget_bytes and not self.pools_short(est)

    def reserve(self, request_id: str, est: MemoryEstimate) -> None:
        self._running[request_id] = est

    def release_loop(self, request_id: str, node: str) -> None:
        """A loop of a running request ended (finished, or stopped early): what it held is free."""
        est = self._running.get(request_id)
        if est is not None and node in est.loop_bytes:
            self._running[request_id] = est.without_loop(node)

    def release(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    @property
    def reserved_bytes(self) -> int:
        return sum(e.held_bytes for e in self._running.values())
