"""NaNWatch: the first NaN/Inf of a request, as module x step (x branch).

Every tapped module output is checked per request segment; module taps fire
innermost-first, so the first non-finite output names the module that produced it (a
NaN weight in ``blocks.1.ffn.proj_out`` is reported there, not at ``blocks.1``). After
each step the loop's latents are checked too (``module="latents"``). A debugging tool:
each check is a host sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from omniloop.ext.hooks import Observer, StepEvent, TapEvent
from omniloop.ext.plugin import Declarations, PluginConfig

logger = logging.getLogger(__name__)

DEFAULT_TAPS = r"(transformer|transformer_2)(\..+)?"


class NaNWatchConfig(PluginConfig):
    taps: str = Field(default=DEFAULT_TAPS, description="regex of the modules whose outputs are checked")
    check_latents: bool = Field(default=True, description="also check the loop state after every step")


@dataclass(frozen=True)
class NaNReport:
    request_id: str
    node: str | None
    module: str
    step: int | None
    branch: str | None
    kind: str  # "nan" | "inf"


class NaNWatch(Observer):
    def __init__(self, name: str, config: NaNWatchConfig) -> None:
        self.name = name
        self.config = config
        self.taps = config.taps
        self.declarations = Declarations(kind="observer", needs_eager=True)
        self.found: dict[str, NaNReport] = {}
        self.checked = 0

    def module_post(self, event: TapEvent) -> None:
        for seg, tensor in event.per_segment():
            if seg is None or seg.request_id in self.found or not tensor.is_floating_point():
                continue
            self.checked += 1
            if not bool(torch.isfinite(tensor).all()):
                node = event.scope.node if event.scope is not None else None
                self._found(NaNReport(seg.request_id, node, event.module, seg.step, seg.branch, _kind(tensor)))

    def step_end(self, event: StepEvent) -> None:
        if not self.config.check_latents or event.request_id in self.found:
            return
        latents = getattr(event.loop, "latents", None)
        tensors = latents.values() if isinstance(latents, dict) else ([latents] if isinstance(latents, torch.Tensor) else [])
        for x in tensors:
            if not bool(torch.isfinite(x).all()):
                self._found(NaNReport(event.request_id, event.node, "latents", event.step, None, _kind(x)))
                return

    def _found(self, report: NaNReport) -> None:
        self.found[report.request_id] = report
        logger.warning("NaNWatch: request %s first non-finite (%s) at %s, step %s, branch %s",
                       report.request_id, report.kind, report.module, report.step, report.branch)

    def first(self, request_id: str) -> NaNReport | None:
        return self.found.get(request_id)

    def metrics(self) -> dict[str, Any]:
        return {"requests_with_nonfinite": len(self.found), "checks": self.checked}


def _kind(x: torch.Tensor) -> str:
    return "nan" if bool(torch.isnan(x).any()) else "inf"
