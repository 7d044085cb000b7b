"""A job's ``OmniEvent`` stream — status, progress, partial artifacts (preview latents,
described), final — over Server-Sent Events or a WebSocket, at the same path.

Both replay the job's history from its first event, so a client that connects late (or
reconnects) sees everything; both end after the ``final`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse

from omniloop.serve.errors import ApiError
from omniloop.serve.jobs import Job, JobKind
from omniloop.serve.state import State, check_auth, get_state, require_auth

router = APIRouter(prefix="/v1/videos", tags=["streaming"])
PATH = "/{video_id}/events"


def sse_event(event: dict) -> str:
    """One Server-Sent Event named by the event's ``type``, the event as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def job_events_sse(job: Job, keepalive_s: float) -> AsyncIterator[str]:
    """The job's events from its first, each as a Server-Sent Event, with a comment line
    every ``keepalive_s`` of quiet (proxies drop idle streams); ends after ``final``."""
    async for event in job.follow(heartbeat_s=keepalive_s):
        yield ": keepalive\n\n" if event is None else sse_event(event)


@router.get(PATH, summary="Server-Sent Events of a video job", dependencies=[Depends(require_auth)],
            responses={200: {"content": {"text/event-stream": {}}}}, response_class=StreamingResponse)
async def video_events(video_id: str, state: State) -> StreamingResponse:
    job = state.job(video_id, JobKind.VIDEO)
    return StreamingResponse(job_events_sse(job, state.config.sse_keepalive_s), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.websocket(PATH)
async def video_events_ws(websocket: WebSocket, video_id: str) -> None:
    """One JSON text message per event; closes with 1000 after ``final``, 4401 on a bad
    API key, 4404 for an unknown job."""
    state = get_state(websocket)
    await websocket.accept()
    try:
        check_auth(websocket)
        job = state.job(video_id, JobKind.VIDEO)
    except ApiError as e:
        await websocket.close(code=4000 + e.status, reason=e.message[:120])
        return
    try:
        async for event in job.follow():
            await websocket.send_json(event)
        await websocket.close(code=1000)
    except WebSocketDisconnect:
        pass  # the client left; the job goes on
