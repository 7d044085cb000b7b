"""CostModel: predicted seconds per schedulable item — the scheduler's budget currency.

Prior: an item's analytic FLOPs (from the stage, e.g. the DiT's matmul count at the
request's token count) over the device's nominal throughput; items without a FLOP
estimate get a flat per-node prior. Calibration: per (node, kind) the ratio of measured
to prior seconds is tracked as an EMA, so predictions converge to this machine's real
speed while keeping the analytic shape dependence (a 4x larger clip is predicted ~4-16x
slower before it was ever seen).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Nominal dense throughput used before any calibration (FLOP/s).
_NOMINAL_FLOPS = {"cuda": 4.0e14, "cpu": 5.0e10, "mps": 5.0e12}


@dataclass(frozen=True)
class ItemCost:
    node: str
    kind: str  # "step" (one loop step), "node" (a one-shot stage), "init", "finalize"
    flops: float | None = None  # analytic estimate, when the stage provides one


@dataclass
class CostModel:
    device_flops: float
    default_item_s: float = 0.01
    ema: float = 0.3
    _ratio: dict[tuple[str, str], float] = field(default_factory=dict)  # measured / prior
    _flat: dict[tuple[str, str], float] = field(default_factory=dict)  # EMA seconds, flop-less items
    observations: int = 0

    @classmethod
    def for_device(cls, device: torch.device) -> "CostModel":
        return cls(device_flops=_NOMINAL_FLOPS.get(device.type, _NOMINAL_FLOPS["cpu"]))

    def prior(self, item: ItemCost) -> float:
        if item.flops is None:
            return self.default_item_s
        return item.flops / self.device_flops

    def predict(self, item: ItemCost) -> float:
        key = (item.node, item.kind)
        if item.flops is None:
            return self._flat.get(key, self.default_item_s)
        return self.prior(item) * self._ratio.get(key, 1.0)

    def observe(self, item: ItemCost, seconds: float) -> None:
        key = (item.node, item.kind)
        self.observations += 1
        if item.flops is None:
            old = self._flat.get(key)
            self._flat[key] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds
            return
        ratio = seconds / max(self.prior(item), 1e-12)
        old = self._ratio.get(key)
        self._ratio[key] = ratio if old is None else (1 - self.ema) * old + self.ema * ratio

    def snapshot(self) -> dict[str, float]:
        out = {f"{n}/{k}/ratio": r for (n, k), r in self._ratio.items()}
        out.update({f"{n}/{k}/seconds": s for (n, k), s in self._flat.items()})
        return out
