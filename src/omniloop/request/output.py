"""``OmniOutput``, per-request metrics and the ``OmniEvent`` stream."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from omniloop.request.artifacts import Artifact, AudioArtifact, ImageArtifact, TextArtifact, VideoArtifact
from omniloop.request.enums import RequestStatus
from omniloop.request.errors import Failure
from omniloop.request.request import SCHEMA_VERSION, OmniRequest


@dataclass(kw_only=True)
class RequestMetrics:
    arrival_time: float = field(default_factory=time.time)
    queue_s: float = 0.0
    run_s: float = 0.0
    steps: int = 0
    seed: int | None = None  # the seed actually used (drawn at random when the request gave none)
    node_s: dict[str, float] = field(default_factory=dict)  # wall seconds per graph node
    peak_memory_bytes: int = 0
    predicted_cost_s: float | None = None
    actual_cost_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class OmniOutput:
    request_id: str
    status: RequestStatus
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    failure: Failure | None = None  # why it ended without its result (None: completed)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    weight_version: str | None = None  # the engine's weights it ran on (Engine.update_weights; None: not run)

    @property
    def error(self) -> str | None:
        """The failure's message (read-only; ``failure`` has its kind and fields)."""
        return None if self.failure is None else self.failure.message

    def _first(self, cls: type) -> Any:
        for art in self.artifacts.values():
            if isinstance(art, cls):
                return art
        return None

    @property
    def video(self) -> VideoArtifact | None:
        return self._first(VideoArtifact)

    @property
    def image(self) -> ImageArtifact | None:
        return self._first(ImageArtifact)

    @property
    def audio(self) -> AudioArtifact | None:
        return self._first(AudioArtifact)

    @property
    def text(self) -> TextArtifact | None:
        return self._first(TextArtifact)

    def describe(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "status": self.status.value,
            "error": self.error,
            "failure": None if self.failure is None else self.failure.to_dict(),
            "artifacts": {name: art.describe() for name, art in self.artifacts.items()},
            "metrics": self.metrics.to_dict(),
            "weight_version": self.weight_version,
        }


# -- events -------------------------------------------------------------------------


@dataclass(kw_only=True)
class OmniEvent:
    """One event of a request's stream. Serialized surfaces carry ``schema_version``."""

    type: ClassVar[str] = "event"
    request_id: str
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "schema_version": SCHEMA_VERSION, "request_id": self.request_id, "time": self.time}


@dataclass(kw_only=True)
class StatusEvent(OmniEvent):
    type: ClassVar[str] = "status"
    status: RequestStatus
    predicted_cost_s: float | None = None  # the engine's cost estimate, published at admission
    # published at admission (the queued event): the resolved request (the model's defaults and the
    # family's fills in: the size, frames and fps that run) and the denoising steps its first denoise
    # loop runs (its node_params steps, else the request's; None: no denoise loop); what a front end
    # reports as the values used
    resolved: OmniRequest | None = None
    steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "status": self.status.value, "predicted_cost_s": self.predicted_cost_s}


@dataclass(kw_only=True)
class ProgressEvent(OmniEvent):
    type: ClassVar[str] = "progress"
    node: str
    step: int  # steps done so far in this node
    total: int
    eta_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "node": self.node, "step": self.step, "total": self.total, "eta_s": self.eta_s}


@dataclass(kw_only=True)
class ArtifactEvent(OmniEvent):
    """A partial (streamed) or final artifact."""

    type: ClassVar[str] = "artifact"
    name: str
    artifact: Artifact
    partial: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "name": self.name, "partial": self.partial, "artifact": self.artifact.describe()}


@dataclass(kw_only=True)
class FinalEvent(OmniEvent):
    type: ClassVar[str] = "final"
    output: OmniOutput

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "output": self.output.describe()}
