"""Typed errors of the request plane: what went wrong (``ErrorKind``), which request fields
are at fault (``fields``), and what to pass instead (``hint``).

A front end (HTTP, CLI, Dynamo) maps a kind to its status code and a field path to its own
spelling of the field (a wire name, a flag); it never reads the message to find out.

Field paths are request-plane paths, spelled as ``OmniRequest`` nests them:
``diffusion.steps``, ``sampling.max_tokens``, ``node_params['denoise'].steps``, ``inputs``,
``task``, ``n`` (images in one call, a front end's field).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class ErrorKind(str, Enum):
    """Why a request was refused or failed. One vocabulary for refusals at admission and
    failures after it (a refusal can become a job's failure, e.g. a re-queued request)."""

    # refused before any work (``InvalidRequest`` and the engine's ``RequestRejected``)
    INVALID_FIELD = "invalid_field"  # a value the caller can fix; ``fields`` name it
    MISSING_INPUT = "missing_input"  # the task needs an input the request lacks (i2v's image)
    UNSUPPORTED_TASK = "unsupported_task"  # the model does not serve the declared task
    UNKNOWN_MODEL = "unknown_model"  # the model named is not served here
    LIMIT_EXCEEDED = "limit_exceeded"  # above a deployment ceiling (``DeployConfig.limits``)
    DOES_NOT_FIT = "does_not_fit"  # cannot fit the memory budget even alone
    QUEUE_FULL = "queue_full"  # retry later
    DRAINING = "draining"  # the engine is shutting down and accepts nothing new
    ASLEEP = "asleep"  # the engine's weights are released (sleep) and it refuses rather than waits: retry
    DUPLICATE = "duplicate"  # the request id is in use
    # failed after admission (``OmniOutput.failure``)
    NON_FINITE = "non_finite"  # NaN/Inf in a loop's state: the request's own numbers overflowed
    STAGE_ERROR = "stage_error"  # a stage or loop raised on this request
    CANCELLED = "cancelled"  # aborted by its caller (or a drain that cancels)
    CONSUMER_FAILED = "consumer_failed"  # the request's event consumer raised
    POOL_FAILED = "pool_failed"  # the worker pool failed under it (restarts exhausted for it)
    ENGINE_DEAD = "engine_dead"  # the engine stopped
    INTERRUPTED = "interrupted"  # the server stopped (or its output vanished) before it finished
    UNKNOWN = "unknown"  # a failure restored from a record that kept only its message (a job store)


class InvalidRequest(ValueError):
    """A request a caller can fix. ``str()`` is the message (with the hint appended after
    "; " when one is given); ``fields`` are the request-plane paths at fault (maybe none);
    ``hint`` says what to pass instead. A ``ValueError``, so plain ``except ValueError``
    callers keep working."""

    def __init__(self, message: str, *, fields: Iterable[str] = (), hint: str | None = None,
                 kind: ErrorKind = ErrorKind.INVALID_FIELD) -> None:
        assert not isinstance(fields, str), f"fields is a tuple of paths, got the string {fields!r}"
        super().__init__(f"{message}; {hint}" if hint else message)
        self.fields: tuple[str, ...] = tuple(fields)
        self.hint = hint
        self.kind = kind

    def failure(self) -> "Failure":
        return Failure(kind=self.kind, message=str(self), fields=self.fields)

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message with request-plane names respelled as a front end spells them
        (``{"diffusion.height": "--height"}``); ``names`` come from ``fields`` (the message
        names its fields by their paths), so this renames known paths, it parses nothing."""
        text = str(self)
        for name, spelling in names.items():
            text = text.replace(name, spelling)
        return text


@dataclass(frozen=True)
class Failure:
    """Why a request ended without its result: ``OmniOutput.failure``."""

    kind: ErrorKind
    message: str
    fields: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "message": self.message, "fields": list(self.fields)}

    def prefixed(self, prefix: str) -> "Failure":
        """The same failure, its message behind ``prefix`` (e.g. the rank it happened on)."""
        return Failure(kind=self.kind, message=f"{prefix}{self.message}", fields=self.fields)


def failure_of(error: BaseException) -> Failure:
    """A failure from an exception raised on a request's behalf (a stage's, a loop's): its
    message names the exception's type; a typed error keeps its kind and fields, anything
    else is a stage error."""
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, InvalidRequest):
        return Failure(kind=error.kind, message=message, fields=error.fields)
    return Failure(kind=ErrorKind.STAGE_ERROR, message=message)


# -- the one pydantic-error formatter ------------------------------------------------------


class _HasErrors(Protocol):
    """pydantic's ``ValidationError`` and FastAPI's ``RequestValidationError``."""

    def errors(self) -> Sequence[Any]: ...


# union members appear in a pydantic loc as type tags ("float", "dict[str,any]", "function-after[...]"): not fields
_TYPE_TAGS = {"float", "int", "str", "bool", "dict", "list", "bytes", "none", "literal"}


@dataclass(frozen=True)
class FieldProblem:
    path: tuple[str, ...]  # field names from the validated model's root (type tags dropped)
    message: str  # pydantic's msg ("Input should be greater than or equal to 1", "Value error, ...")
    type: str  # pydantic's error type ("greater_than_equal", "extra_forbidden", ...)


@dataclass(frozen=True)
class ValidationMessage:
    """A validation error in the one message format: ``field: problem`` per problem joined
    by "; ", and the fields in that order (spelled as in the message)."""

    message: str
    fields: tuple[str, ...]

    @property
    def first_field(self) -> str | None:
        return self.fields[0] if self.fields else None

    def error(self, kind: ErrorKind = ErrorKind.INVALID_FIELD) -> InvalidRequest:
        return InvalidRequest(self.message, fields=self.fields, kind=kind)


def field_problems(error: _HasErrors, *, drop_location: bool = False) -> list[FieldProblem]:
    """pydantic's ``errors()`` as typed problems. ``drop_location``: the loc starts with
    FastAPI's location ("body", "query", ...), which is not a field."""
    problems = []
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ())]
        if drop_location and loc[:1] in (["body"], ["query"], ["path"], ["header"]):
            loc = loc[1:]
        path = tuple(p for p in loc if p not in _TYPE_TAGS and "[" not in p)
        problems.append(FieldProblem(path=path, message=str(item.get("msg", "invalid")), type=str(item.get("type", ""))))
    return problems


def format_validation_error(error: _HasErrors | Sequence[FieldProblem], *, prefix: str = "",
                            names: Mapping[str, str] | None = None, root: str = "",
                            messages: Mapping[str, str] | None = None) -> ValidationMessage:
    """The one format of a pydantic error: ``prefix.field.path: message`` per problem.

    ``names`` respells a path's first field (request-plane name -> the caller's, e.g. a
    wire name); ``root`` names a problem of the whole object (no field, no prefix);
    ``messages`` replaces pydantic's message for an error type (``extra_forbidden`` -> how
    to find the accepted fields)."""
    problems = error if isinstance(error, Sequence) else field_problems(error)
    lines, fields = [], []
    for problem in problems:
        path = list(problem.path)
        if path and names:
            path[0] = names.get(path[0], path[0])
        where = ".".join(([prefix] if prefix else []) + path) or root
        lines.append(f"{where}: {(messages or {}).get(problem.type, problem.message)}")
        fields.append(where)
    return ValidationMessage("; ".join(lines), tuple(fields))
