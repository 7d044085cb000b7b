"""Sleep / wake storage: the modules and cache pools a sleep releases, kept on the host and
restored on wake (``engine/weights.py`` schedules them as barrier ops).

Level 1 releases the components the request loops step (the DiT, the LM) and drops the KV
pools' storage, keeping the VAE and text encoders; level 2 releases every module. Released
weights go to a host copy (pinned CPU memory on a device; on a CPU the tensors themselves are
kept aside), so weights updated before a sleep survive it and outputs after wake are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from omniloop.pipeline.pipeline import Pipeline


@runtime_checkable
class ReleasableStorage(Protocol):
    """A cache pool whose storage the engine may drop while nothing holds it (sleep)."""

    def drop_storage(self) -> int: ...


@dataclass
class Released:
    """One module's tensors put aside by a sleep: (tensor object, its data kept on the host)."""

    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.device]]

    @classmethod
    @torch.no_grad()
    def of(cls, module: nn.Module) -> "Released":
        kept = []
        seen: set[int] = set()
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            device = t.device
            # NOTE: a CPU deployment keeps the tensor's own storage aside (nothing to gain from a copy);
            # a device's weights go to (pinned) host memory and the device storage is freed
            host = t.data if device.type == "cpu" else _pinned_copy(t.data)
            kept.append((t, host, device))
            t.data = torch.empty(0, dtype=t.dtype, device=device)
        return cls(kept)

    @torch.no_grad()
    def restore(self) -> None:
        for t, host, device in self.tensors:
            t.data = host if device.type == "cpu" else host.to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy (the wake's host-to-device copies run at full bandwidth)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t)
    return host


@dataclass
class SleepReport:
    level: int
    released_bytes: int  # device bytes of the released modules and pools
    components: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "released_bytes": self.released_bytes, "components": list(self.components),
                "seconds": self.seconds}


def loop_components(pipeline: Pipeline) -> set[str]:
    """Components the request loops step (the DiT, the LM, their KV pools): what level 1 drops."""
    return {c for node in pipeline.spec.nodes if node.is_loop and node.stage.progress_steps
            for c in node.stage.components}
