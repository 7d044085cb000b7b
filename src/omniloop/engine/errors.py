"""Engine errors. Recoverable ones concern one request; ``EngineDeadError`` means the
engine itself cannot continue (vLLM's EngineGenerateError / EngineDeadError split).

A refusal at admission is a ``RequestRejected``: an ``InvalidRequest`` (request plane) with
its ``kind``, the request ``fields`` at fault and a ``hint``, which a front end maps to a
status code and its own field names (``serve/errors.py``, the CLI, the Dynamo worker).
"""

from __future__ import annotations

from omniloop.pipeline.failures import PoolFatalError  # raised inside steps (pipeline), handled here
from omniloop.request import ErrorKind, InvalidRequest

__all__ = ["DoesNotFit", "EngineDeadError", "EngineError", "PoolFatalError", "QueueFull", "RequestRejected",
           "UnknownRequest"]


class EngineError(RuntimeError):
    """Base class of errors the engine raises to callers."""


class RequestRejected(EngineError, InvalidRequest):
    """Admission refused a request (validation, duplicate id, cannot fit); nothing was queued.
    ``kind`` says why, ``fields`` which request fields (request-plane paths, maybe none)."""

    default_kind = ErrorKind.INVALID_FIELD

    def __init__(self, message: str, *, fields: tuple[str, ...] = (), hint: str | None = None,
                 kind: ErrorKind | None = None) -> None:
        InvalidRequest.__init__(self, message, fields=fields, hint=hint, kind=kind or self.default_kind)

    @classmethod
    def of(cls, error: InvalidRequest) -> "RequestRejected":
        """``error`` (raised by a validator below the engine) as the engine's refusal, its
        kind, fields and message kept."""
        if isinstance(error, RequestRejected):
            return error
        rejected = cls(str(error), fields=error.fields, kind=error.kind)
        rejected.hint = error.hint  # its text ends the message already
        return rejected


class QueueFull(RequestRejected):
    """Retry later (``kind`` queue_full), or never here (``kind`` draining)."""

    default_kind = ErrorKind.QUEUE_FULL


class DoesNotFit(RequestRejected):
    default_kind = ErrorKind.DOES_NOT_FIT


class UnknownRequest(EngineError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class EngineDeadError(EngineError):
    """The engine stopped (pool restarts exhausted, or shut down)."""
