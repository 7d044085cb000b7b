"""``when`` predicates on a request's task and options.

A predicate is evaluated on the request at run time and also analysed at build time:
``tasks()`` returns the tasks it can be true for (None: any), which is what validation
uses to find nodes unreachable for every declared task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from omniloop.request import OmniRequest, TaskType


class Predicate:
    def __call__(self, request: OmniRequest) -> bool:
        raise NotImplementedError

    def tasks(self) -> frozenset[TaskType] | None:
        """Tasks for which this may be true; None means it does not constrain the task."""
        raise NotImplementedError

    @property
    def pure(self) -> bool:
        """True when the value depends on the task alone (then ``tasks()`` is exact)."""
        raise NotImplementedError

    def __or__(self, other: "Predicate") -> "Predicate":
        return _Or(self, other)

    def __and__(self, other: "Predicate") -> "Predicate":
        return _And(self, other)

    def __invert__(self) -> "Predicate":
        return _Not(self)


@dataclass(frozen=True)
class task_in(Predicate):  # noqa: N801 - reads as a declaration: when=task_in(I2V)
    members: frozenset[TaskType]

    def __init__(self, *tasks: TaskType | Iterable[TaskType]) -> None:
        flat: list[TaskType] = []
        for t in tasks:
            flat.extend([t] if isinstance(t, (TaskType, str)) else t)
        object.__setattr__(self, "members", frozenset(TaskType(t) for t in flat))

    def __call__(self, request: OmniRequest) -> bool:
        return request.task in self.members

    def tasks(self) -> frozenset[TaskType] | None:
        return self.members

    @property
    def pure(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"task_in({', '.join(sorted(t.value for t in self.members))})"


@dataclass(frozen=True)
class opt(Predicate):  # noqa: N801
    """True when ``test(request)`` holds; ``name`` documents the option in errors."""

    name: str
    test: Callable[[OmniRequest], bool]

    def __call__(self, request: OmniRequest) -> bool:
        return bool(self.test(request))

    def tasks(self) -> frozenset[TaskType] | None:
        return None

    @property
    def pure(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"opt({self.name})"


@dataclass(frozen=True)
class _Pair(Predicate):
    """Two predicates joined (``|`` / ``&``): pure when both are."""

    a: Predicate
    b: Predicate

    @property
    def pure(self) -> bool:
        return self.a.pure and self.b.pure


@dataclass(frozen=True)
class _Or(_Pair):
    def __call__(self, request: OmniRequest) -> bool:
        return self.a(request) or self.b(request)

    def tasks(self) -> frozenset[TaskType] | None:
        ta, tb = self.a.tasks(), self.b.tasks()
        return None if ta is None or tb is None else ta | tb

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


@dataclass(frozen=True)
class _And(_Pair):
    def __call__(self, request: OmniRequest) -> bool:
        return self.a(request) and self.b(request)

    def tasks(self) -> frozenset[TaskType] | None:
        ta, tb = self.a.tasks(), self.b.tasks()
        if ta is None:
            return tb
        return ta if tb is None else ta & tb

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


@dataclass(frozen=True)
class _Not(Predicate):
    a: Predicate

    def __call__(self, request: OmniRequest) -> bool:
        return not self.a(request)

    def tasks(self) -> frozenset[TaskType] | None:
        # ~P is certainly false only where P is certainly true, i.e. for a pure P on its tasks.
        ta = self.a.tasks()
        return frozenset(TaskType) - ta if self.a.pure and ta is not None else None

    @property
    def pure(self) -> bool:
        return self.a.pure

    def __repr__(self) -> str:
        return f"~{self.a!r}"
