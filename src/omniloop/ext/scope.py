"""Who a forward is for: the (request, CFG branch, step) of every batch row.

A batched step stacks several requests and guidance branches along the batch dim. The
loop publishes a :class:`ForwardScope` while the model runs, so module taps can attribute
the rows of a tapped tensor to their request, branch and step. A block interceptor that
runs blocks on a subset of rows publishes the matching sub-scope for that span.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``start:stop`` of a forward's batch belong to one (request, branch)."""

    request_id: str
    branch: str | None
    step: int | None
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ForwardScope:
    node: str
    component: str | None
    segments: tuple[Segment, ...]

    @property
    def batch(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    def split(self, tensor: torch.Tensor) -> list[tuple[Segment | None, torch.Tensor]]:
        """Batch-first tensors are split per segment; a batch-1 tensor is shared by all; with
        one segment (one request) the whole tensor is that request's."""
        if len(self.segments) == 1:
            return [(self.segments[0], tensor)]
        if tensor.ndim > 0 and tensor.shape[0] == self.batch:
            return [(s, tensor[s.start : s.stop]) for s in self.segments]
        if tensor.ndim > 0 and tensor.shape[0] == 1:
            return [(s, tensor) for s in self.segments]
        return [(None, tensor)]

    def subset(self, indices: Sequence[int]) -> "ForwardScope":
        """The scope of the chosen segments, re-packed contiguously (a row subset's view)."""
        out, start = [], 0
        for i in indices:
            s = self.segments[i]
            out.append(Segment(s.request_id, s.branch, s.step, start, start + s.rows))
            start += s.rows
        return ForwardScope(self.node, self.component, tuple(out))


def request_scope(node: str, request_id: str) -> ForwardScope:
    """The scope of a one-shot node run for one request (encoders, VAE decode)."""
    return ForwardScope(node, None, (Segment(request_id, None, None, 0, 1),))


_SCOPE: ContextVar[ForwardScope | None] = ContextVar("omniloop_forward_scope", default=None)


def current_scope() -> ForwardScope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def using_scope(scope: ForwardScope | None) -> Iterator[None]:
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)
