"""What a failure inside a step means, and the one helper that keeps it a request's own.

Two kinds of failure reach a loop or stage:

* a request's own (a bad value in its latents, a policy or sampler raising on its state,
  its consumer going away): it fails that request and nothing else. Past the model
  forward of a batched step, every per-request slot runs through :func:`per_request`, so
  one request's exception is recorded against it while its batch-mates finish the step;
* the pool's (:class:`PoolFatalError`: a CUDA illegal access, an NCCL desync): every
  in-flight request is affected, so it is never caught per request.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


class PoolFatalError(RuntimeError):
    """Raised from inside a step when the worker pool itself is corrupt (a CUDA illegal
    access, an NCCL desync). Every in-flight request is affected, not just one; the engine
    restarts the pool and re-queues or fails the in-flight requests."""


def attempt(errors: list[BaseException | None], i: int, fn: Callable[[], T]) -> T | None:
    """``fn()`` on behalf of request ``i`` unless it failed already; an exception becomes
    ``errors[i]`` (a ``PoolFatalError`` propagates). Returns its result, None on failure."""
    if errors[i] is not None:
        return None
    try:
        return fn()
    except PoolFatalError:
        raise
    except Exception as exc:  # this request's own failure
        errors[i] = exc
        return None


def per_request(errors: list[BaseException | None], fn: Callable[[int], T]) -> list[T | None]:
    """``fn(i)`` for every request ``i`` not failed yet (``errors[i] is None``), in order:
    one request's exception is recorded in ``errors[i]`` (it is out of the step from then
    on) and the others go on. Returns the results, None for failed requests."""
    return [attempt(errors, i, partial(fn, i)) for i in range(len(errors))]


def first_error(errors: Sequence[BaseException | None]) -> BaseException | None:
    return next((e for e in errors if e is not None), None)
