"""Graph fan-out: one-shot nodes of one request whose inputs are ready run at the same time.

After a joint denoise, LTX-2's video decode and its audio decode + vocoder read only the
loop's latents: neither waits for the other. The scheduler names such siblings in its
``NodeWork`` (``parallel``), and the engine runs them on a small thread pool - each on its
own CUDA stream on a GPU, so their kernels overlap; on a CPU, PyTorch releases the GIL in
its ops, so the two decodes overlap on the cores - instead of one after the other on the
request's critical path.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from omniloop.pipeline.spec import Node


def ready_siblings(nodes: Sequence[Node], index: int) -> tuple[Node, ...]:
    """The one-shot nodes right after ``nodes[index]`` (a one-shot node) that read and write
    no edge of the nodes from ``index`` up to them: they can run together with it."""
    if index >= len(nodes) or nodes[index].is_loop:
        return ()
    pending = set(nodes[index].output_edges())
    siblings = []
    for node in nodes[index + 1:]:
        if node.is_loop:
            break
        reads = set(node.input_edges()) | set(node.input_edges(optional=True))
        writes = set(node.output_edges())
        if reads & pending or writes & pending:
            break
        siblings.append(node)
        pending |= writes
    return tuple(siblings)


@dataclass(frozen=True)
class Ran:
    seconds: float  # the node's own wall time (the nodes overlap)
    error: BaseException | None


class FanOutPool:
    """Runs a few callables at once; created lazily, shared by one engine's iterations."""

    def __init__(self, device: torch.device, workers: int = 4) -> None:
        self.device = torch.device(device)
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fns: Sequence[Callable[[], None]]) -> list[Ran]:
        """Every ``fn`` concurrently; returns when all are done (each one's time and error)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="omniloop-fanout")
        inference = torch.is_inference_mode_enabled()  # thread-local: the workers take the caller's mode
        # A worker's intra-op thread count is fixed at its first op from the process-wide count
        # of that moment (another engine or a test may have changed it since); the caller's count
        # makes a node's floats the same whether it ran here or on the engine thread.
        threads = torch.get_num_threads()
        cuda = self.device.type == "cuda"
        parent = torch.cuda.current_stream(self.device) if cuda else None

        def call(fn: Callable[[], None]) -> Ran:
            t0 = time.perf_counter()
            try:
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                with torch.inference_mode(inference):
                    if cuda:  # its own stream, after the work already queued on the caller's
                        assert parent is not None, "a CUDA fan-out takes the caller's stream"
                        stream = torch.cuda.Stream(self.device)
                        stream.wait_stream(parent)
                        with torch.cuda.stream(stream):
                            fn()
                        stream.synchronize()  # what it wrote is ready for the caller's stream
                    else:
                        fn()
            except BaseException as exc:  # reported to the engine, which fails the request
                return Ran(time.perf_counter() - t0, exc)
            return Ran(time.perf_counter() - t0, None)

        return list(self._pool.map(call, fns))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
