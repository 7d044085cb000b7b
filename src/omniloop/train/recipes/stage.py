"""What every recipe stage returns and leaves on disk: a ``StageResult`` and ``result.json``.

A stage (VAE, latents, DiT, trajectories, student, export, evaluate) lives in one folder
of the work dir. It is finished when its ``result.json`` exists; until then, running it
again resumes it. ``result.json`` is written last and atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from omniloop.models.manifest import MANIFEST_FILE

RESULT_FILE = "result.json"


@dataclass(frozen=True)
class StageResult:
    stage: str
    status: Literal["done", "paused"]
    path: Path  # the stage's folder
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status == "done"


class ShardClock:
    """Paces a stage that writes shards under a call's deadline.

    A shard starts only when one more is expected to end before ``deadline``, judged by the
    mean time of the shards made in this call; the first shard of a call always starts (each
    call makes progress). Checking ``now >= deadline`` alone starts a shard a moment before
    the deadline and runs one shard past it (75 s on an H200 for 1,024 rollouts), past the
    caller's hard time limit, which then kills the call before it can publish anything.
    """

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.start = time.monotonic()
        self.made = 0

    def may_start(self) -> bool:
        if self.deadline is None or self.made == 0:
            return True
        now = time.monotonic()
        return now + (now - self.start) / self.made <= self.deadline

    def finished_one(self) -> None:
        self.made += 1

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


def source_runs(component_dir: str | Path | None, stage: str) -> list[int]:
    """Training steps, run by run, behind weights a stage starts from or adopts: read from the
    manifest of the model that ships them (``<model>/omniloop_model.json`` next to the
    component folder), so a model continued over several sessions records its whole history.
    Empty for a folder that is not part of a shipped model (a fresh run's weights)."""
    if component_dir is None:
        return []
    manifest = Path(component_dir).resolve().parent / MANIFEST_FILE
    if not manifest.is_file():
        return []
    provenance = json.loads(manifest.read_text()).get("provenance") or {}
    runs = (provenance.get("steps_by_run") or {}).get(stage)
    if runs is None:
        steps = (provenance.get("steps") or {}).get(stage)
        runs = [] if steps is None else [steps]
    return [int(s) for s in runs]


def source_tasks(component_dir: str | Path | None) -> list[str]:
    """The tasks the shipped model owning ``component_dir`` declares (its manifest next to the
    component folder); empty for a folder outside a shipped model."""
    if component_dir is None:
        return []
    manifest = Path(component_dir).resolve().parent / MANIFEST_FILE
    return list(json.loads(manifest.read_text()).get("tasks") or []) if manifest.is_file() else []


def stage_runs(result: dict[str, Any]) -> list[int]:
    """All training runs behind a finished stage's weights: the source's, then this one's
    (none for adopted weights)."""
    own = [] if result.get("adopted_from") or result.get("steps") is None else [int(result["steps"])]
    return [*result.get("earlier_runs", []), *own]


def adopted_result(out: Path, folder: str | Path, what: str) -> dict[str, Any] | None:
    """The finished result of a stage that adopted ``folder``; None when it has not run yet.
    A stage that holds other weights (trained, or adopted from elsewhere) is an error: one
    work dir never mixes two models."""
    done = read_result(out)
    if done is not None and done.get("adopted_from") != str(folder):
        raise ValueError(f"{out} already holds a {what} ({done.get('adopted_from') or 'trained here'}), not "
                         f"{folder}; use another --work to start over with this one")
    return done


def read_result(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / RESULT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_result(folder: Path, info: dict[str, Any]) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RESULT_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, folder / RESULT_FILE)


def require_done(folder: Path, what: str) -> dict[str, Any]:
    """The result of a stage this one depends on; a clear error when it has not finished."""
    result = read_result(folder)
    if result is None:
        raise FileNotFoundError(f"{Path(folder) / RESULT_FILE} not found: run the {what} stage first")
    return result


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def serving_dtype(device: torch.device) -> torch.dtype:
    """The dtype a deployment on ``device`` runs (DeployConfig's 'auto'): validation and
    evaluation sample in it, so what is measured is what is served."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
