"""Parity checks on N gloo ranks (``omniloop.parallel.launch.run_on_ranks``), with the
one-process reference computed at the ranks' thread count."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch

from omniloop.parallel.launch import rank_threads as _pool_rule
from omniloop.parallel.launch import run_on_ranks


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300) -> list[Any]:
    return run_on_ranks(fn, world, *args, timeout_s=timeout, preload=("tests.factories",))


def rank_threads(world: int) -> int:
    """Threads per CPU rank: the ranks share this machine's cores (the pool's rule)."""
    return _pool_rule(world, torch.device("cpu"))


@contextmanager
def threads(n: int):
    """Compute a one-process reference with the ranks' thread count: CPU kernels may round
    differently with another number of threads, and the parity checks are bitwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
