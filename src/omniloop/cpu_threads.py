"""How many intra-op threads torch should use on a CPU deployment (``DeployConfig.cpu_threads``).

torch's default is one thread per core of the machine, which is wrong twice on a shared or
containerised box: the process may be allowed fewer cores (CPU affinity, a cgroup quota),
and the cores may be busy. OpenMP threads meet at a barrier after every parallel region,
so one thread that the kernel deschedules stalls all of them.
NOTE: measured on this project's 2-vCPU box under load (issue 15): the same shapes job
took 29.7 s with torch's 2 threads and 5.4 s with 1.

``"auto"`` takes the smallest of

* torch's current count (so an explicit ``OMP_NUM_THREADS`` or ``torch.set_num_threads``
  is never raised),
* the cores this process may run on (``os.sched_getaffinity``),
* the cgroup CPU quota rounded up (``/sys/fs/cgroup/cpu.max``; cgroup v1's
  ``cpu.cfs_quota_us / cpu.cfs_period_us``),
* the cores left idle by the machine's 1-minute load average (``os.cpu_count() -
  loadavg``, rounded: a load of 0.1 on 2 cores leaves 2, of 1.3 leaves 1),

and at least 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """What ``auto_threads`` read, for logs and tests."""

    current: int  # torch's thread count before
    affinity: int  # cores this process may run on
    quota: float | None  # cgroup quota in cores (None: unlimited or unreadable)
    machine: int  # os.cpu_count()
    load: float | None  # 1-minute load average (None: unavailable)

    @property
    def idle(self) -> int | None:
        """Cores the load average leaves idle (rounded)."""
        return None if self.load is None else int(round(self.machine - self.load))

    @property
    def threads(self) -> int:
        limits = [self.current, self.affinity]
        if self.quota is not None:
            limits.append(math.ceil(self.quota - 1e-9))
        if self.idle is not None:
            limits.append(self.idle)
        return max(1, min(limits))


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2 ``cpu.max``, else v1), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def read_budget(root: Path = CGROUP_ROOT) -> CpuBudget:
    import torch

    machine = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = machine
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return CpuBudget(torch.get_num_threads(), affinity, cgroup_quota(root), machine, load)


def apply_cpu_threads(setting: int | str) -> int:
    """Set torch's intra-op threads from a ``DeployConfig.cpu_threads`` value; returns the count."""
    import torch

    threads = read_budget().threads if setting == "auto" else int(setting)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
