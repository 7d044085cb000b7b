"""Admission: a bounded queue and a memory budget.

Every request carries (resident bytes, peak activation bytes) estimated at admission. The
pool admits a request to run only while the sum of running residents plus the largest
peak among them (steps run one batch at a time) stays within the budget; a request that
could never fit, even alone, is rejected at once. "No room" is a return value
(``can_start``), not an exception (STYLE.md 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class MemoryEstimate:
    resident_bytes: int = 0  # held from start to finish (latents, embeddings, KV, history)
    peak_bytes: int = 0  # transient activations of one step of this request

    def __add__(self, other: "MemoryEstimate") -> "MemoryEstimate":
        return MemoryEstimate(self.resident_bytes + other.resident_bytes, max(self.peak_bytes, other.peak_bytes))


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
    _running: dict[str, MemoryEstimate] = field(default_factory=dict)

    def fits_alone(self, est: MemoryEstimate) -> bool:
        return est.resident_bytes + est.peak_bytes <= self.budget_bytes

    def can_start(self, est: MemoryEstimate) -> bool:
        resident = sum(e.resident_bytes for e in self._running.values()) + est.resident_bytes
        peak = max([e.peak_bytes for e in self._running.values()] + [est.peak_bytes])
        return resident + peak <= self.budget_bytes

    def reserve(self, request_id: str, est: MemoryEstimate) -> None:
        self._running[request_id] = est

    def release(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    @property
    def reserved_bytes(self) -> int:
        return sum(e.resident_bytes for e in self._running.values())
