"""ParityAligner: record taps of a reference run, replay and report the first divergence.

``record`` mode dumps every tapped module output per (step, branch) of a request to
``<path>/<request_id>.pt`` when the request ends. ``compare`` mode loads that file when the
same request id starts (replay it with the same seed) and compares each tap as it is
produced: ``max|x - ref| > atol + rtol * max|ref|`` is a divergence. The report lists
divergences in execution order; its ``first`` is the earliest module x step that went
wrong (module taps fire innermost-first, so a perturbed Linear is named before its
block). Per-tap tolerances: ``tolerances={regex: [atol, rtol]}`` (first match wins).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from omniloop.ext.hooks import Observer, RequestEvent, TapEvent
from omniloop.ext.plugin import Declarations, PluginConfig

logger = logging.getLogger(__name__)

DEFAULT_TAPS = r"(transformer|transformer_2)\.blocks\.\d+(\..+)?"


class ParityAlignerConfig(PluginConfig):
    mode: Literal["record", "compare"]
    path: str = Field(description="directory of reference dumps (<request_id>.pt) and reports")
    taps: str = Field(default=DEFAULT_TAPS, description="regex over component-qualified module names")
    steps: list[int] | None = Field(default=None, description="only these step indices (None: all)")
    atol: float = Field(default=1e-5, ge=0)
    rtol: float = Field(default=1e-4, ge=0)
    tolerances: dict[str, tuple[float, float]] = Field(default_factory=dict, description="regex -> (atol, rtol)")


@dataclass(frozen=True)
class Divergence:
    module: str
    step: int | None
    branch: str | None
    max_abs: float
    tolerance: float


@dataclass
class ParityReport:
    request_id: str
    compared: int = 0
    missing_reference: bool = False
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    @property
    def ok(self) -> bool:
        return not self.missing_reference and not self.divergences

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "first": asdict(self.first) if self.first else None}


class ParityAligner(Observer):
    def __init__(self, name: str, config: ParityAlignerConfig) -> None:
        self.name = name
        self.config = config
        self.taps = config.taps
        self.declarations = Declarations(kind="observer", needs_eager=True)
        self.path = Path(config.path)
        self._steps = set(config.steps) if config.steps is not None else None
        self._tolerances = [(re.compile(rx), tol) for rx, tol in config.tolerances.items()]
        self._live: dict[str, dict[str, torch.Tensor]] = {}  # record: request -> key -> tensor
        self._refs: dict[str, dict[str, torch.Tensor]] = {}  # compare: request -> key -> reference
        self._counts: dict[str, dict[str, int]] = {}  # request -> (module, step, branch) -> calls
        self.reports: dict[str, ParityReport] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def request_start(self, event: RequestEvent) -> None:
        rid = event.request_id
        self._counts[rid] = {}
        if self.config.mode == "record":
            self._live[rid] = {}
            return
        file = self._file(rid)
        self.reports[rid] = ParityReport(rid, missing_reference=not file.is_file())
        self._refs[rid] = torch.load(file, map_location="cpu") if file.is_file() else {}

    def request_end(self, event: RequestEvent) -> None:
        rid = event.request_id
        self._counts.pop(rid, None)
        if self.config.mode == "record":
            self.path.mkdir(parents=True, exist_ok=True)
            torch.save(self._live.pop(rid, {}), self._file(rid))
            return
        self._refs.pop(rid, None)
        report = self.reports.get(rid)
        if report is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / f"{_safe(rid)}.report.json").write_text(json.dumps(report.to_dict(), indent=1))
            if report.first is not None:
                f = report.first
                logger.warning("parity: request %s first diverges at %s step %s branch %s (max|diff| %.3g > %.3g)",
                               rid, f.module, f.step, f.branch, f.max_abs, f.tolerance)

    # -- taps ----------------------------------------------------------------------------------
    def module_post(self, event: TapEvent) -> None:
        for seg, tensor in event.per_segment():
            if seg is None or (self._steps is not None and seg.step not in self._steps):
                continue
            rid = seg.request_id
            counts = self._counts.get(rid)
            if counts is None:
                continue
            base = f"{event.module}|{seg.step}|{seg.branch}"
            n = counts[base] = counts.get(base, -1) + 1
            key = f"{base}#{n}"
            if self.config.mode == "record":
                self._live[rid][key] = tensor.detach().to("cpu", copy=True)
            else:
                self._compare(rid, key, event.module, seg.step, seg.branch, tensor)

    def _compare(self, rid: str, key: str, module: str, step: int | None, branch: str | None, x: torch.Tensor) -> None:
        ref = self._refs[rid].get(key)
        report = self.reports[rid]
        if ref is None:
            return
        report.compared += 1
        x = x.detach().float().cpu()
        ref = ref.float()
        if x.shape != ref.shape:
            report.divergences.append(Divergence(module, step, branch, float("inf"), 0.0))
            return
        atol, rtol = self._tolerance(module)
        max_abs = (x - ref).abs().max().item() if x.numel() else 0.0
        tol = atol + rtol * (ref.abs().max().item() if ref.numel() else 0.0)
        if not max_abs <= tol:  # NaN counts as a divergence
            report.divergences.append(Divergence(module, step, branch, max_abs, tol))

    def _tolerance(self, module: str) -> tuple[float, float]:
        for rx, tol in self._tolerances:
            if rx.search(module):
                return tol
        return self.config.atol, self.config.rtol

    def _file(self, request_id: str) -> Path:
        return self.path / f"{_safe(request_id)}.pt"

    def report(self, request_id: str) -> ParityReport | None:
        return self.reports.get(request_id)

    def metrics(self) -> dict[str, Any]:
        return {"mode": self.config.mode, "reports": len(self.reports),
                "diverged": sum(1 for r in list(self.reports.values()) if r.divergences)}


def _safe(request_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", request_id)
