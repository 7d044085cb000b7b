"""Run a function on N gloo ranks (child processes on 127.0.0.1) and collect what each returns.

Children come from one forkserver that has torch and omniloop imported already, so a
2-rank run costs well under a second after the first (spawning fresh interpreters costs
~4 s each on a 2-core CI machine).
"""

from __future__ import annotations

import io
import traceback
from contextlib import contextmanager
from typing import Any, Callable

import torch



def context():
    from omniloop.engine.pool import process_context

    return process_context(("tests.parallel.ranks", "tests.factories"))


def _child(fn, rank: int, world: int, port: int, threads: int, args: tuple, queue) -> None:
    import torch.distributed as dist

    from omniloop.parallel.mesh import init_process_group

    try:
        torch.set_num_threads(threads)
        init_process_group(rank, world, port, torch.device("cpu"), timeout_s=120)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        buffer = io.BytesIO()  # bytes, not shared-memory tensors: this process exits right after
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def rank_threads(world: int) -> int:
    """Threads per rank: the ranks share this machine's cores (the pool's rule)."""
    from omniloop.engine.pool import rank_threads as pool_rule

    return pool_rule(world, torch.device("cpu"))


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


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks (a module-level function); results by rank."""
    from omniloop.parallel.mesh import free_port

    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    threads = rank_threads(world)
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, threads, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in procs:
        rank, status, value = queue.get(timeout=timeout)
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=timeout)
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]
