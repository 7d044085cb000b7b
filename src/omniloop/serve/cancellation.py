"""A synchronous call's jobs end with its client: ``wait_or_abort`` waits for the jobs to
seal while watching the connection, and cancels the unsealed ones at their next step if the
client goes away (an image call whose client timed out no longer runs to the end)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from starlette.requests import Request

from omniloop.serve.errors import ApiError
from omniloop.serve.jobs import Job
from omniloop.serve.runner import JobRunner

POLL_S = 0.25  # how often the connection is looked at while the jobs run


async def wait_or_abort(request: Request, jobs: Sequence[Job], runner: JobRunner) -> None:
    """Return once every job is sealed; if the client disconnects first, cancel the rest and
    raise a 499 (nobody reads it: it ends the handler)."""
    sealed = asyncio.ensure_future(asyncio.gather(*(job.wait_sealed() for job in jobs)))
    try:
        while not sealed.done():
            await asyncio.wait({sealed}, timeout=POLL_S)
            if not sealed.done() and await request.is_disconnected():
                for job in jobs:
                    if not job.sealed:
                        await runner.request_cancel(job)
                raise ApiError(499, "the client disconnected; its images were cancelled", code="client_gone")
    finally:
        if not sealed.done():
            sealed.cancel()
