"""The message loop of a worker process rank 0 drives over a pipe: an SPMD pool's ranks
1..N-1 (engine/pool_worker.py) and a role pool's worker (engine/role_worker.py).

The worker answers each message with one reply, in order, until rank 0 says stop (``None``)
or goes away (the pipe closes: the worker exits quietly, there is nobody left to answer). A
message the worker cannot handle kills it: it logs the traceback, sends rank 0 its typed
failure message (``RankFailed`` / ``PoolFailed``) and exits without interpreter teardown.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPipe:
    """A worker's end of its pipe to rank 0."""

    conn: Any  # multiprocessing Connection
    name: str  # who the worker is, for the log: "rank 1", "pool vae"
    failed: Callable[[str], Any]  # the traceback -> the typed failure message rank 0 reads


def serve_messages(pipe: WorkerPipe, handle: Callable[[Any], Any]) -> None:
    """Send ``handle(msg)`` back for each message the pipe receives, under inference mode;
    return when rank 0 sends ``None``; exit the process (0) when rank 0 is gone; die (see
    :func:`die`) when ``handle`` raises."""
    with torch.inference_mode():
        while True:
            try:
                msg = pipe.conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                os._exit(0)
            if msg is None:
                return
            try:
                pipe.conn.send(handle(msg))
            except BaseException:
                die(pipe)


def die(pipe: WorkerPipe) -> NoReturn:
    """Called in an ``except`` block: log the traceback, send rank 0 the failure message, exit (1)."""
    error = traceback.format_exc()
    logger.error("%s failed:\n%s", pipe.name, error)
    try:
        pipe.conn.send(pipe.failed(error))
    finally:
        os._exit(1)  # no interpreter teardown: a broken process group can hang it
