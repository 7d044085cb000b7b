"""What every recipe stage returns and leaves on disk: a ``StageResult`` and ``result.json``.

A stage (VAE, latents, DiT, trajectories, student, export, evaluate) lives in one folder
of the work dir. It is finished when its ``result.json`` exists; until then, running it
again resumes it. ``result.json`` is written last and atomically.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

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
