"""Run a function on N gloo ranks (child processes on 127.0.0.1) and collect what each returns.

Children come from one forkserver that has torch and omniloop imported already, so a
2-rank run costs well under a second after the first (spawning fresh interpreters costs
~4 s each on a 2-core CI machine).
"""

from __future__ import annotations

import io
import traceback
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


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks (a module-level function); results by rank."""
    from omniloop.parallel.mesh import free_port

    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, torch.get_num_threads(), args, queue), daemon=True)
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
