"""Vocabulary of the request plane, defined once (STYLE.md 11)."""

from __future__ import annotations

from enum import Enum


class TaskType(str, Enum):
    """What the user asks for. Declared by the caller, never inferred from inputs."""

    T2V = "t2v"  # text -> video
    I2V = "i2v"  # image (first frame) + text -> video
    TI2V = "ti2v"  # text with an optional image -> video (one model for both)
    V2V = "v2v"  # video + text -> video
    T2I = "t2i"  # text -> image
    I2I = "i2i"  # image + text -> image
    T2A = "t2a"  # text -> audio
    T2VS = "t2vs"  # text -> video with sound
    REASON = "reason"  # multimodal in -> text out
    V2W = "v2w"  # video (+ actions) -> world-model rollout
    A2W = "a2w"  # actions -> world-model rollout

    @property
    def makes_image(self) -> bool:
        """The task's pixel output is one image (t2i, i2i), not a video."""
        return self in (TaskType.T2I, TaskType.I2I)


class Modality(str, Enum):
    TEXT = "text"
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"
    ACTION = "action"
    LATENT = "latent"


class RequestStatus(str, Enum):
    """Lifecycle of one request; ``finished`` is a property, not scattered checks."""

    QUEUED = "queued"
    RUNNING = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED)
