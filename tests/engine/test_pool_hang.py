"""A rank that stops answering (alive, but silent: SIGSTOP) is pool-fatal, not request-fatal.

gloo reports the peer that no longer answers as a plain RuntimeError raised inside the
collective ("Timed out waiting ... for send operation to complete"), after the pool's
``timeout_s``; rank 0 must treat it as the pool's failure (restart, re-queue), not fail the
request it happened to be running. The re-queued request then finishes as on one process.
Its own module: it needs a pool with a short timeout (one pool per process at a time).
"""

from __future__ import annotations

import os
import signal
import time

import torch

from omniloop.deploy import DeployConfig
from omniloop.engine import Engine, EngineConfig
from omniloop.engine.pool import launch_pool_engine
from omniloop.request import RequestStatus
from tests.engine.conftest import req, run_all
from tests.parallel.ranks import rank_threads, threads

TIMEOUT_S = 4.0


def test_a_silent_rank_is_pool_fatal_and_the_request_requeued(wan_t2v_dir, wan_pipeline):
    reference = Engine(wan_pipeline, EngineConfig())
    reference.add_request(req(seed=0, steps=3, rid="r0", guidance_scale=4.0))
    with threads(rank_threads(2)):
        expected = run_all(reference)[0]["r0"].artifacts["latents"].latents

    engine = launch_pool_engine(wan_t2v_dir, DeployConfig(device="cpu", parallel=f"sp=2,timeout_s={TIMEOUT_S}"))
    try:
        engine.add_request(req(seed=0, steps=3, rid="r0", guidance_scale=4.0))
        with torch.inference_mode():
            while engine.scheduler.running.get("r0") is None or engine.scheduler.running["r0"].loop is None:
                engine.step()
            stalled = engine.pool._procs[0]
            os.kill(stalled.pid, signal.SIGSTOP)  # alive, its pipe open: only the timeout can tell
            t0 = time.perf_counter()
            outs, _ = run_all(engine)
        recovered_s = time.perf_counter() - t0
        assert engine.stats.pool_restarts == 1 and engine.stats.failed == 0
        assert stalled.exitcode is not None, "the restart killed the stalled rank (it would never read a stop)"
        out = outs["r0"]
        assert out.status is RequestStatus.COMPLETED, out.error
        assert torch.equal(out.artifacts["latents"].latents, expected)  # re-run from scratch, Ulysses bitwise
        assert recovered_s >= TIMEOUT_S  # the collective's timeout is what noticed it
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()
