"""Starting rank processes: the forkserver they are forked from, how many CPU threads each
gets, and :func:`run_on_ranks` — a function run on N ranks of a fresh process group (the
parity tests and ``benchmarks/bench_parallel.py`` use it; the engine's pool starts its
ranks the same way, ``engine/pool.py``).
"""

from __future__ import annotations

import io
import os
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

# Ranks are forked from one forkserver that imported these already (torch, the engine, every
# family: ``engine/pool_worker.py`` imports them): a rank then starts in well under a second
# instead of paying a fresh interpreter's imports.
FORKSERVER_PRELOAD = ["omniloop.engine.pool_worker"]


def process_context(device: torch.device, preload: tuple[str, ...] = ()):
    """How rank processes start. CPU: forked from a forkserver (its preload list counts when
    the server starts, once per process: the first caller's list decides what later forks
    find imported). CUDA: spawned — a fresh interpreter per rank (seconds more), because a
    process that touched the CUDA driver (an import that asks ``torch.cuda.is_available()``
    is enough) cannot hand a working CUDA to its forks."""
    if device.type == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, *preload])
    return ctx


def rank_threads(world: int, device: torch.device) -> int:
    """CPU threads of every rank: on a CPU pool the ranks share this machine's cores (more
    threads than cores make every small op wait on spinning barriers); on GPUs, this process's.

    NOTE: CPU kernels may round differently with another thread count, so a CPU pool equals
    a one-process run bit for bit only when that run used the same number of threads.
    """
    if device.type != "cpu":
        return torch.get_num_threads()
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) // world))


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, device: str, threads: int, timeout_s: float,
           args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    from omniloop.parallel.mesh import init_process_group

    try:
        torch.set_num_threads(threads)
        init_process_group(rank, world, port, rank_device(torch.device(device), rank), timeout_s)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        buffer = io.BytesIO()  # bytes, not shared-memory tensors: this process exits right after
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, device: str = "cpu", timeout_s: float = 600,
                 preload: tuple[str, ...] = ()) -> list[Any]:
    """``fn(rank, world, *args)`` (a module-level function) on ``world`` ranks of a fresh process
    group (gloo on CPU, NCCL on GPUs: rank r on cuda:r); what each returns, by rank."""
    from omniloop.parallel.mesh import rendezvous_store

    ctx = process_context(torch.device(device), preload)
    queue = ctx.Queue()
    store = rendezvous_store(timeout_s)  # this process holds the rendezvous; the ranks are all children
    port = store.port
    threads = rank_threads(world, torch.device(device))
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, device, threads, timeout_s, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.exitcode is None:
                p.kill()
        queue.close()
        queue.join_thread()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
