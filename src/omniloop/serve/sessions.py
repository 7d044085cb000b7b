"""Live sessions: a causal video model's open-ended rollout, steered while it plays.

``POST /v1/sessions`` (``model`` -- the served model when omitted --, ``prompt``, ``size``,
``seed``, ``steps``, ``max_chunks`` or open-ended, ``realtime``) starts one engine request
whose ``ChunkRollout`` goes on chunk after chunk; ``GET`` describes it, ``DELETE`` ends it.
A WebSocket at ``/v1/sessions/{id}/stream`` takes JSON text messages --
``{"type": "action", "action": "left"}`` (a name of the model's action vocabulary, listed by
``/v1/models``), ``{"type": "prompt", "prompt": "..."}``, ``{"type": "flush"}`` (discard the
chunk in flight) -- and sends, for each chunk, one JSON text event (``{"type": "chunk",
"index": i, ...}``) followed by one binary message: that chunk's fMP4 media segment, the first
one prefixed by the init segment, ready for a MediaSource. A bad message gets an
``{"type": "error", ...}`` frame and the session goes on; the session's end is an
``{"type": "end", ...}`` event, then close 1000.

A session makes chunks only while a client is connected to its stream: it is created paused
(``Engine.pause``: admitted, its state kept, none of its steps run), resumes when its first
client connects and pauses again when its last one leaves, so a tab that was closed or never
opened its stream takes no engine time from the sessions people watch. One nobody ever
connects to expires after ``ServeConfig.session_connect_grace_s``; one whose clients left
ends after ``session_idle_s`` unless a client comes back (a reloaded /play page reconnects to
its session). Beyond ``max_sessions`` live ones a new one is refused (429). Sessions
interleave (and batch) on the one engine like any requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omniloop.engine import EngineError, UnknownRequest
from omniloop.io.fmp4 import MIME, FragmentedMP4Stream
from omniloop.pipeline.loops.chunk import Flush
from omniloop.request import (ActionPart, ArtifactEvent, FieldError, Fields, FinalEvent, OmniRequest, OutputSpec,
                              RequestStatus, TaskType, TextPart, VideoChunkArtifact, build_request,
                              format_validation_error)
from omniloop.serve.backpressure import session_wait_s
from omniloop.serve.errors import ApiError, api_error, parse_body, validation_error
from omniloop.serve.session_inbox import SessionInbox
from omniloop.serve.state import ServeState, State, check_auth, get_state, new_id, require_auth
from omniloop.serve.wire import ServedModel

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
ROLLOUT_NODE = "rollout"
WS_BINARY_REFUSED = 4415  # 4000 + HTTP 415: the stream takes JSON text messages only
KEEP_CHUNKS = 4  # chunks a session keeps for a client that (re)connects: it starts at the oldest


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/Infinity: a 400 naming it

    model: str | None = Field(default=None, description="the served model (default: this server's)")
    prompt: str = Field(min_length=1, max_length=4000)
    size: str | None = Field(default=None, pattern=r"^\d+x\d+$", description="WIDTHxHEIGHT, e.g. 832x480")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    steps: int | None = Field(default=None, ge=1, le=100, description="denoise steps per chunk")
    negative_prompt: str | None = None
    guidance_scale: float | None = Field(default=None, ge=0, description="CFG scale of the chunks after the first "
                                         "(default: the model's)")
    first_chunk_guidance_scale: float | None = Field(default=None, ge=0, description="CFG scale of chunk 0, the one "
                                                     "made from the prompt alone (default: the model's)")
    first_chunk_steps: int | None = Field(default=None, ge=1, le=100, description="denoise steps of chunk 0 "
                                          "(default: the model's)")
    max_chunks: int | None = Field(default=None, ge=1, description="chunks to make; omit for open-ended")
    realtime: bool = Field(default=True, description="pace chunks to playback instead of running ahead")
    fps: int | None = Field(default=None, ge=1, le=120)


# the body's DiffusionParams fields (size gives height and width)
SESSION_FIELDS = {"seed", "steps", "negative_prompt", "fps", "guidance_scale"}
# the body's rollout knobs (ChunkRolloutParams fields: node_params of the rollout node)
ROLLOUT_FIELDS = {"first_chunk_guidance_scale", "first_chunk_steps", "max_chunks", "realtime"}


def session_request(body: SessionCreate, session_id: str) -> OmniRequest:
    """The open-ended rollout a session runs (the prompt as sent: the body refuses an empty one)."""
    width, height = (int(v) for v in body.size.split("x")) if body.size else (None, None)
    params = Fields()
    params.put_flat({"height": height, "width": width, **body.model_dump(include=SESSION_FIELDS)})
    try:
        return build_request(TaskType.T2V, None, params, parts=[TextPart(text=body.prompt)], request_id=session_id,
                             outputs=OutputSpec(stream=True),
                             node_params={ROLLOUT_NODE: {"open_ended": True, **body.model_dump(
                                 include=ROLLOUT_FIELDS, exclude_none=True)}})
    except FieldError as e:
        raise ApiError(400, str(e), param=e.field, code=e.code) from None


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    status: str
    created_at: int
    chunks: int  # made so far
    max_chunks: int | None
    actions: list[str]
    clients: int = 0  # connected to its stream now; with none it makes no chunks
    error: str | None = None


class ClientMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["action", "prompt", "flush"]
    action: str | None = None
    prompt: str | None = Field(default=None, min_length=1, max_length=4000)


@dataclass(eq=False)
class Session:
    id: str
    model: str
    max_chunks: int | None
    fps: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: RequestStatus = RequestStatus.QUEUED
    error: str | None = None
    chunks: list[tuple[dict[str, Any], bytes]] = field(default_factory=list)  # (event, segment) of recent chunks
    made: int = 0  # chunks made so far
    init_segment: bytes | None = None
    clients: int = 0
    connected: bool = False  # a client has connected at least once (before: the connect grace applies)
    last_seen: float = field(default_factory=time.monotonic)
    ended: bool = False
    ended_at: float | None = None  # monotonic; an ended session is described for session_idle_s more
    task: asyncio.Task | None = None
    inbox: SessionInbox = field(default_factory=SessionInbox)  # steering messages, coalesced between chunks
    _tick: asyncio.Event = field(default_factory=asyncio.Event)
    _fmp4: FragmentedMP4Stream | None = None

    def wake(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()


class SessionManager:
    """The live sessions of one server (bounded), their event followers and idle expiry.

    Sessions run on ``engine``: the server's own, or a second one serving its interactive
    model (``ServeConfig.session_model``; ``omniloop serve`` without ``--model`` starts the
    built-in shapes-interactive there)."""

    def __init__(self, state: ServeState, engine: Any = None) -> None:
        self.state = state
        self.engine = engine if engine is not None else state.engine
        self.model = ServedModel.of(engine) if engine is not None else state.model
        self.own_engine = engine is not None
        self.sessions: dict[str, Session] = {}
        self.max_sessions = int(getattr(state.config, "max_sessions", 4))
        self.idle_s = float(getattr(state.config, "session_idle_s", 60.0))
        self.connect_grace_s = float(getattr(state.config, "session_connect_grace_s", 10.0))
        self._reaper: asyncio.Task | None = None

    @property
    def actions(self) -> dict[str, list[list[float]]]:
        return dict(self.model.defaults.actions or {})

    def live(self) -> list[Session]:
        return [s for s in self.sessions.values() if not s.ended]

    # -- lifecycle ------------------------------------------------------------------------
    async def create(self, body: SessionCreate) -> Session:
        model = self.model
        if body.model is not None and body.model != model.name and body.model not in model.aliases:
            raise ApiError(404, f"model {body.model!r} does not serve sessions here; pass {model.name!r} or omit model",
                           param="model", code="model_not_found")
        if len(self.live()) >= self.max_sessions:
            raise ApiError(429, f"{self.max_sessions} sessions are live (max_sessions); end one "
                           "(DELETE /v1/sessions/{id}) or retry after Retry-After seconds", code="too_many_sessions")
        sid = new_id("session")
        request = session_request(body, sid)
        fps = body.fps or model.defaults.fps or 16
        session = Session(id=sid, model=model.name, max_chunks=body.max_chunks, fps=fps)
        stream = self.engine.stream(request, paused=True)  # it runs while a client watches (serve_client)
        try:
            first = await anext(stream)  # the submit: a rejection raises here, nothing is kept
        except EngineError as e:
            raise api_error(e) from None
        self._apply(session, first)
        self.sessions[sid] = session
        session.task = asyncio.create_task(self._follow(session, stream), name=f"session-{sid}")
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="omniloop-session-expiry")
        return session

    async def end(self, session: Session, reason: str | None = None) -> None:
        if reason is not None and not session.ended:
            session.error = session.error or reason
        with contextlib.suppress(UnknownRequest):
            await self.engine.abort(session.id)

    def get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise ApiError(404, f"no session {sid!r} (never created, ended or expired); create one with "
                           "POST /v1/sessions", param="session_id", code="session_not_found")
        return session

    async def close(self) -> None:
        for session in self.live():
            await self.end(session)
        if self._reaper is not None:
            self._reaper.cancel()

    # -- following the engine -------------------------------------------------------------
    async def _follow(self, session: Session, stream) -> None:
        try:
            async for event in stream:
                if isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, VideoChunkArtifact):
                    await asyncio.to_thread(self._add_chunk, session, event.artifact)
                    await self._forward(session, session.inbox.on_chunk())
                elif isinstance(event, FinalEvent):  # why it ended, when we ended it, beats "cancelled by request"
                    session.status, session.error = event.output.status, session.error or event.output.error
                else:
                    self._apply(session, event)
                session.wake()
        except Exception:  # a bug here must not take the server down
            logger.exception("following session %s failed", session.id)
            session.status, session.error = RequestStatus.FAILED, "internal error while following the session"
        finally:
            session.ended, session.ended_at = True, time.monotonic()
            if not session.status.finished:
                session.status = RequestStatus.CANCELLED
            session.wake()

    @staticmethod
    def _apply(session: Session, event: Any) -> None:
        status = getattr(event, "status", None)
        if isinstance(status, RequestStatus):
            session.status = status

    @staticmethod
    def _add_chunk(session: Session, art: VideoChunkArtifact) -> None:
        if session._fmp4 is None:
            _, height, width, _ = art.frames.shape
            session._fmp4 = FragmentedMP4Stream(width, height, art.fps)
        segment = session._fmp4.add_chunk(art.frames)
        session.init_segment = session._fmp4.init_segment
        event = {"type": "chunk", "index": art.index, "first_frame": art.first_frame, "num_frames": art.num_frames,
                 "fps": art.fps, "action": art.action, "prompt": art.prompt, "mime": MIME,
                 "time": time.time()}
        session.chunks = [*session.chunks, (event, segment)][-KEEP_CHUNKS:]
        session.made = art.index + 1

    async def _reap(self) -> None:
        """End sessions no client connected to within ``connect_grace_s``, and those whose
        clients left ``idle_s`` ago; forget ended ones after ``idle_s``."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 4, self.connect_grace_s / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.ended and session.clients == 0:
                    if now - (session.ended_at or now) > self.idle_s:
                        self.sessions.pop(session.id, None)
                elif not session.ended and session.clients == 0 and (reason := self._expired(session, now)):
                    logger.info("session %s: %s", session.id, reason)
                    await self.end(session, reason)

    def _expired(self, session: Session, now: float) -> str | None:
        unwatched = now - session.last_seen
        if not session.connected and unwatched > self.connect_grace_s:
            return f"expired: no client connected within {self.connect_grace_s:g} s (session_connect_grace_s)"
        if session.connected and unwatched > self.idle_s:
            return f"expired: no client for {self.idle_s:g} s (session_idle_s)"
        return None

    # -- one client -----------------------------------------------------------------------
    async def serve_client(self, websocket: WebSocket, session: Session) -> None:
        session.clients += 1
        session.connected = True
        session.last_seen = time.monotonic()
        if session.clients == 1:
            await self._set_watched(session, True)  # someone watches: make chunks
        sender = asyncio.create_task(self._send_chunks(websocket, session))
        try:
            while not sender.done():
                receive = asyncio.create_task(websocket.receive())
                done, _ = await asyncio.wait({receive, sender}, return_when=asyncio.FIRST_COMPLETED)
                if receive not in done:
                    receive.cancel()
                    break
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is None:  # a binary frame: the protocol is JSON text
                    await websocket.close(code=WS_BINARY_REFUSED, reason="binary messages are not accepted; send "
                                          "JSON text like {\"type\": \"prompt\", \"prompt\": \"...\"}")
                    break
                session.last_seen = time.monotonic()
                reply = await self._handle(session, message["text"])
                if reply is not None:
                    await websocket.send_json(reply)
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away
        finally:
            sender.cancel()
            session.clients -= 1
            session.last_seen = time.monotonic()
            if session.clients == 0 and not session.ended:
                await self._set_watched(session, False)  # nobody watches: hold it until one comes back (or idle_s)
            with contextlib.suppress(Exception):
                await websocket.close(code=1000)

    async def _set_watched(self, session: Session, watched: bool) -> None:
        """Resume (``watched``) or pause the session's engine request."""
        with contextlib.suppress(UnknownRequest):  # it ended meanwhile
            await (self.engine.resume if watched else self.engine.pause)(session.id)

    async def _send_chunks(self, websocket: WebSocket, session: Session) -> None:
        sent = session.chunks[0][0]["index"] - 1 if session.chunks else -1
        first = True
        while True:
            tick = session._tick
            for event, segment in list(session.chunks):
                if event["index"] <= sent:
                    continue
                await websocket.send_json(event)
                payload = (session.init_segment or b"") + segment if first else segment
                await websocket.send_bytes(payload)
                first, sent = False, event["index"]
            if session.ended:
                await websocket.send_json({"type": "end", "status": session.status.value, "error": session.error,
                                           "chunks": session.made})
                await websocket.close(code=1000)
                return
            await tick.wait()

    async def _handle(self, session: Session, text: str) -> dict[str, Any] | None:
        """One client message -> the engine; an error frame (and the session goes on) if bad."""
        try:
            message = ClientMessage.model_validate_json(text)
        except ValidationError as e:
            fields = format_validation_error(e, root="message").message
            return _error(f"malformed message ({fields}); send JSON like {{\"type\": \"prompt\", \"prompt\": \"...\"}}, "
                          f"{{\"type\": \"action\", \"action\": <name>}} or {{\"type\": \"flush\"}}")
        if message.type == "action":
            actions = self.actions
            if message.action not in actions:
                known = sorted(actions) or "none: this model takes prompts, not actions"
                return _error(f"unknown action {message.action!r}; this model's actions: {known}")
            item: Any = ActionPart(name=message.action, values=actions[message.action])
        elif message.type == "prompt":
            if message.prompt is None:
                return _error("a prompt message needs 'prompt': the new text")
            item = TextPart(text=message.prompt)
        else:
            item = Flush()
        if session.ended:
            return _error(f"session {session.id} has ended")
        await self._forward(session, session.inbox.offer(item))  # held and coalesced while a chunk is made
        return None

    async def _forward(self, session: Session, items: list[Any]) -> None:
        for item in items:
            with contextlib.suppress(UnknownRequest):  # it ended meanwhile: nothing to steer
                await self.engine.send(session.id, item)

    def retry_after_s(self) -> float:
        """Seconds until a session slot may free (``serve/backpressure.py``)."""
        unwatched = [(s.connected, s.last_seen) for s in self.live() if s.clients == 0]
        return session_wait_s(unwatched, self.connect_grace_s, self.idle_s)


def _error(message: str) -> dict[str, Any]:
    return {"type": "error", "message": message}


def manager(state: ServeState) -> SessionManager:
    found = getattr(state, "sessions", None)
    if found is None:
        found = state.sessions = SessionManager(state)  # type: ignore[attr-defined]
    return found


def attach_session_engine(state: ServeState, engine: Any) -> SessionManager:
    """Serve sessions from ``engine`` (an interactive model's) instead of the server's own."""
    state.sessions = SessionManager(state, engine)  # type: ignore[attr-defined]
    return state.sessions  # type: ignore[attr-defined]


def session_object(mgr: SessionManager, session: Session) -> SessionObject:
    return SessionObject(id=session.id, model=session.model, status=session.status.value,
                         created_at=session.created_at, chunks=session.made, max_chunks=session.max_chunks,
                         actions=sorted(mgr.actions), clients=session.clients, error=session.error)


@router.post("", response_model=SessionObject, summary="Start a live session", dependencies=[Depends(require_auth)])
async def create_session(request: Request, state: State) -> SessionObject:
    """One T2V session of the served model; 429 beyond ``max_sessions`` live ones."""
    state.check_accepting()
    try:
        data = await request.json()
    except ValueError:
        raise ApiError(400, "the body must be a JSON object like {\"prompt\": \"...\"}", code="invalid_json") from None
    body = parse_body(SessionCreate, data)
    mgr = manager(state)
    return session_object(mgr, await mgr.create(body))


@router.get("/{session_id}", response_model=SessionObject, summary="Describe a session",
            dependencies=[Depends(require_auth)])
async def get_session(session_id: str, state: State) -> SessionObject:
    mgr = manager(state)
    return session_object(mgr, mgr.get(session_id))


@router.delete("/{session_id}", summary="End a session", dependencies=[Depends(require_auth)])
async def delete_session(session_id: str, state: State) -> dict[str, Any]:
    mgr = manager(state)
    session = mgr.get(session_id)
    await mgr.end(session, "ended by DELETE")
    return {"id": session.id, "object": "session", "deleted": True}


@router.websocket("/{session_id}/stream")
async def session_stream(websocket: WebSocket, session_id: str) -> None:
    """Chunks out (a JSON event, then its fMP4 segment), steering messages in. Closes with
    4401 on a bad API key and 4404 for a session that does not exist (or ended)."""
    state = get_state(websocket)
    await websocket.accept()
    try:
        check_auth(websocket)
        mgr = manager(state)
        session = mgr.get(session_id)
    except ApiError as e:
        await websocket.close(code=4000 + e.status, reason=e.message[:120])
        return
    await mgr.serve_client(websocket, session)
