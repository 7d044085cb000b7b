"""Engine errors. Recoverable ones concern one request; ``EngineDeadError`` means the
engine itself cannot continue (vLLM's EngineGenerateError / EngineDeadError split)."""

from __future__ import annotations

from omniloop.pipeline.failures import PoolFatalError  # raised inside steps (pipeline), handled here

__all__ = ["DoesNotFit", "EngineDeadError", "EngineError", "PoolFatalError", "QueueFull", "RequestRejected",
           "UnknownRequest"]


class EngineError(RuntimeError):
    """Base class of errors the engine raises to callers."""


class RequestRejected(EngineError, ValueError):
    """Admission refused a request (validation, duplicate id, cannot fit). ``status_code`` is
    what an HTTP front end should answer."""

    status_code = 400


class QueueFull(RequestRejected):
    status_code = 429


class DoesNotFit(RequestRejected):
    status_code = 413


class UnknownRequest(EngineError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class EngineDeadError(EngineError):
    """The engine stopped (pool restarts exhausted, or shut down)."""
