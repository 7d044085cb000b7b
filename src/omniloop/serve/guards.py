"""``BodyLimit``: every request body and WebSocket message capped while it streams in.

One ASGI middleware in front of every route, so no route can read more than the server
allows, whatever it reads its body with (``read_body``, ``request.json()``, FastAPI's own
body parameter):

- HTTP: a ``Content-Length`` over ``max_upload_bytes`` is a 413 before a byte of the body is
  read; a chunked body is counted as it arrives and refused (413) at the first chunk past
  the cap, the rest never read (the connection then closes).
- JSON bodies (``application/json``, ``*+json`` or no content type) are read whole (within
  the cap) and their nesting depth checked before any route parses them: deeper than
  ``max_json_depth`` is a 400 naming the depth (Python's parser would otherwise recurse
  until RecursionError, a 500).
- WebSocket messages over ``max_ws_message_bytes`` close the socket with 4413 and a reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

WS_TOO_LARGE = 4413  # 4000 + HTTP 413, as the session stream's other close codes (4401, 4404)


class BodyTooLarge(Exception):
    """Raised into the route by the capped ``receive``; the middleware answers 413."""


async def refuse(send: Send, status: int, message: str, *, param: str, code: str,
                 headers: dict[str, str] | None = None) -> None:
    """An OpenAI-shaped error response sent straight from a middleware (no route ran)."""
    kind = {400: "invalid_request_error", 403: "permission_error", 413: "request_too_large",
            415: "invalid_request_error", 421: "invalid_request_error"}.get(status, "error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def is_json(content_type: str | None) -> bool:
    ctype = (content_type or "").split(";")[0].strip().lower()
    return ctype in ("", "application/json") or ctype.endswith("+json")


_ESCAPE = re.compile(rb"\\.", re.S)  # one escaped character inside a string
_STRING = re.compile(rb'"[^"]*"')  # a string, once its escapes are gone
_CHUNK = 1 << 20


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in JSON text ``raw`` (brackets inside strings do
    not count), without parsing it: C-speed regexes drop the strings, numpy counts the rest
    in 1 MiB chunks (memory O(chunk), not O(body))."""
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    text = _STRING.sub(b"", _ESCAPE.sub(b"", raw))
    deepest = depth = 0
    for start in range(0, len(text), _CHUNK):
        chunk = np.frombuffer(text, dtype=np.uint8, count=min(_CHUNK, len(text) - start), offset=start)
        steps = (np.isin(chunk, (ord("["), ord("{"))).astype(np.int32)
                 - np.isin(chunk, (ord("]"), ord("}"))).astype(np.int32))
        levels = np.cumsum(steps, dtype=np.int64) + depth
        if len(levels):
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


class BodyLimit:
    """The caps above, as a pure ASGI middleware (``app.add_middleware(BodyLimit, ...)``)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, max_json_depth: int, max_ws_message_bytes: int) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_json_depth
        self.max_ws = max_ws_message_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.app(scope, self._ws_receive(receive, send), send)
        else:
            await self.app(scope, receive, send)

    # -- HTTP -------------------------------------------------------------------------------
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, f"{declared} bytes exceed")
            return
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        if scope["method"] in ("POST", "PUT", "PATCH") and is_json(header(scope, b"content-type")):
            await self._json(scope, capped, send)
            return
        answered = False

        async def tracked(message: Message) -> None:
            nonlocal answered
            if seen > self.max_bytes:
                return  # the route's own answer to the exception is replaced by the 413 below
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped, tracked)
        except BodyTooLarge:
            pass
        if seen > self.max_bytes and not answered:
            await self._too_large(send, "more than")

    async def _json(self, scope: Scope, capped: Receive, send: Send) -> None:
        """Read the whole (capped) JSON body, check its depth, then hand it to the route."""
        parts: list[bytes] = []
        try:
            while True:
                message = await capped()
                if message["type"] != "http.request":
                    return  # the client left mid-body
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except BodyTooLarge:
            await self._too_large(send, "more than")
            return
        body = b"".join(parts)
        depth = json_depth(body)
        if depth > self.max_depth:
            await refuse(send, 400, f"body: JSON nested {depth} deep; this server accepts at most "
                         f"{self.max_depth} levels (max_json_depth)", param="body", code="too_deep")
            return
        await self.app(scope, replay_body(body, capped), send)

    async def _too_large(self, send: Send, how: str) -> None:
        await refuse(send, 413, f"body: {how} this server's limit of {self.max_bytes} bytes (max_upload_bytes)",
                     param="body", code="request_too_large")

    # -- WebSocket --------------------------------------------------------------------------
    def _ws_receive(self, receive: Receive, send: Send) -> Receive:
        async def capped() -> Message:
            message = await receive()
            if message["type"] == "websocket.receive":
                size = len(message["bytes"]) if message.get("bytes") is not None else len(
                    (message.get("text") or "").encode())
                if size > self.max_ws:
                    reason = f"message of {size} bytes exceeds {self.max_ws} (max_ws_message_bytes)"
                    await send({"type": "websocket.close", "code": WS_TOO_LARGE, "reason": reason})
                    return {"type": "websocket.disconnect", "code": WS_TOO_LARGE}
            return message

        return capped


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` (already read, whole) as one message, then
    whatever ``receive`` gives after it (the disconnect, when it comes)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
