"""ActivationTrace: regex-selected module outputs, per request, per step and branch.

Records, for each tapped module call of a request, either summary statistics (mean,
std, absmax; the default) or a CPU copy of the rows belonging to that request. With
``opt_in`` only requests that pass ``plugin_params={"activation_trace": {"enabled":
true}}`` are traced, so one deployment can trace single requests in production.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.ext.hooks import Observer, RequestEvent, TapEvent
from omniloop.ext.plugin import Declarations, PluginConfig


class ActivationTraceConfig(PluginConfig):
    taps: str = Field(description="regex over component-qualified module names, e.g. 'transformer\\.blocks\\.\\d+'")
    steps: list[int] | None = Field(default=None, description="trace only these step indices (None: all)")
    mode: Literal["stats", "tensor"] = Field(default="stats", description="summary statistics or CPU tensor copies")
    opt_in: bool = Field(default=False, description="trace only requests that set plugin_params enabled=true")
    max_requests: int = Field(default=64, ge=1, description="traces kept (oldest dropped first)")


class ActivationTraceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True


@dataclass(frozen=True)
class TraceRecord:
    module: str
    step: int | None
    branch: str | None
    value: Any  # {"mean", "std", "absmax"} or a CPU tensor


class ActivationTrace(Observer):
    def __init__(self, name: str, config: ActivationTraceConfig) -> None:
        self.name = name
        self.config = config
        self.taps = config.taps
        self.declarations = Declarations(kind="observer", needs_eager=True)
        self._steps = set(config.steps) if config.steps is not None else None
        self._traces: OrderedDict[str, list[TraceRecord]] = OrderedDict()
        self._selected: set[str] = set()

    def request_start(self, event: RequestEvent) -> None:
        params = event.request.diffusion.plugin_params.get(self.name, {}) if event.request is not None else {}
        if not self.config.opt_in or params.get("enabled", False):
            self._selected.add(event.request_id)
            self._traces[event.request_id] = []
            while len(self._traces) > self.config.max_requests:
                self._traces.popitem(last=False)

    def request_end(self, event: RequestEvent) -> None:
        self._selected.discard(event.request_id)

    def module_post(self, event: TapEvent) -> None:
        for seg, tensor in event.per_segment():
            if seg is None or seg.request_id not in self._selected:
                continue
            if self._steps is not None and seg.step not in self._steps:
                continue
            self._traces[seg.request_id].append(TraceRecord(event.module, seg.step, seg.branch, self._value(tensor)))

    def _value(self, tensor: torch.Tensor) -> Any:
        if self.config.mode == "tensor":
            return tensor.detach().to("cpu", copy=True)
        x = tensor.detach().float()
        mean, std, absmax = torch.stack((x.mean(), x.std() if x.numel() > 1 else x.new_zeros(()), x.abs().max())).tolist()
        return {"mean": mean, "std": std, "absmax": absmax}

    def records(self, request_id: str) -> list[TraceRecord]:
        return list(self._traces.get(request_id, []))

    def pop(self, request_id: str) -> list[TraceRecord]:
        return self._traces.pop(request_id, [])

    def metrics(self) -> dict[str, Any]:
        return {"requests_traced": len(self._traces), "records": sum(len(v) for v in list(self._traces.values()))}
