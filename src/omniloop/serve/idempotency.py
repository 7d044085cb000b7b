"""``Idempotency-Key`` on the job-creating POSTs: a client's retry gets the job it already
made instead of a second one.

``Idempotent`` (an ASGI middleware inside the body cap) keys each ``POST`` to
``IDEMPOTENT_PATHS`` that carries an ``Idempotency-Key`` header by that key, and remembers
a digest of the path and body with the answer:

- a new key runs the request; a 2xx answer is kept (an error is not: the retry runs again);
- the same key with the same body answers the kept response again (the same job id), marked
  ``Idempotent-Replayed: true``; one arriving while the first still runs waits for it;
- the same key with another body or path is a 409 naming the header.

Kept answers are bounded: the newest ``max_keys`` keys, and at most ``max_bytes`` of bodies
(the oldest are forgotten first), each for ``ttl_s`` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from omniloop.serve.guards import ASGIApp, Message, Receive, Scope, Send, header, refuse, replay_body

IDEMPOTENT_PATHS = frozenset({"/v1/videos", "/v1/images/generations", "/v1/images/edits", "/v1/sessions"})


@dataclass
class _Kept:
    digest: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    at: float = field(default_factory=time.monotonic)


class Idempotent:
    def __init__(self, app: ASGIApp, *, max_keys: int = 1024, max_bytes: int = 64 * 2**20,
                 ttl_s: float = 24 * 3600.0) -> None:
        self.app, self.max_keys, self.max_bytes, self.ttl_s = app, max_keys, max_bytes, ttl_s
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = header(scope, b"idempotency-key") if scope["type"] == "http" else None
        if key is None or scope["method"] != "POST" or scope["path"] not in IDEMPOTENT_PATHS:
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:  # within the body cap (BodyLimit sits outside)
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        digest = hashlib.sha256(scope["path"].encode() + b"\0" + body).hexdigest()
        self._forget_old()
        kept = self._kept.get(key)
        if kept is not None:
            await self._answer_again(kept, digest, send)
            return
        kept = self._kept[key] = _Kept(digest)
        try:
            await self.app(scope, replay_body(body, receive), self._keeping(kept, send))
        finally:
            if not 200 <= kept.status < 300:
                self._kept.pop(key, None)  # an error is not kept: a retry runs again
            kept.done.set()
            self._fit()

    async def _answer_again(self, kept: _Kept, digest: str, send: Send) -> None:
        if kept.digest != digest:
            await refuse(send, 409, "Idempotency-Key: this key was used with another request body; send a new key "
                         "for a new request", param="Idempotency-Key", code="idempotency_conflict")
            return
        await kept.done.wait()
        if not 200 <= kept.status < 300:  # the first attempt failed meanwhile: it was not kept
            await refuse(send, 409, "Idempotency-Key: the first request with this key failed; retry with it now",
                         param="Idempotency-Key", code="idempotency_retry")
            return
        await send({"type": "http.response.start", "status": kept.status,
                    "headers": [*kept.headers, (b"idempotent-replayed", b"true")]})
        await send({"type": "http.response.body", "body": kept.body})

    @staticmethod
    def _keeping(kept: _Kept, send: Send) -> Send:
        async def keeping(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept.status, kept.headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                kept.body += message.get("body", b"")
            await send(message)

        return keeping

    def _forget_old(self) -> None:
        now = time.monotonic()
        for key in [k for k, v in self._kept.items() if v.done.is_set() and now - v.at > self.ttl_s]:
            del self._kept[key]

    def _fit(self) -> None:
        while len(self._kept) > self.max_keys or sum(v.body.__len__() for v in self._kept.values()) > self.max_bytes:
            oldest = next((k for k, v in self._kept.items() if v.done.is_set()), None)
            if oldest is None:
                return
            del self._kept[oldest]
