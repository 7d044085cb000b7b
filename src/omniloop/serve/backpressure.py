"""``Retry-After`` on every 429, computed from the work ahead instead of a fixed second.

``RetryAfter`` (an ASGI middleware) rewrites the header of every 429 the routes answer (a
full engine queue, a full job store, too many live sessions), so no refusal goes out
without one and each says when retrying is worth it:

- job routes: the seconds until one request's worth of the queued work is done -- the
  engine's predicted backlog (``AsyncEngine.stats()["backlog_s"]``: the cost model's
  seconds left over every running and queued request) divided by their number;
- ``/v1/sessions``: the soonest a live session ends on its own -- an unwatched one at its
  expiry (``session_connect_grace_s`` / ``session_idle_s`` after it was last watched), a
  watched one no sooner than ``session_idle_s``.

Either is rounded up and clamped to [1, 600] seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from omniloop.serve.guards import ASGIApp, Message, Receive, Scope, Send

MIN_S, MAX_S = 1, 600


def header_value(seconds: float) -> str:
    return str(min(MAX_S, max(MIN_S, math.ceil(seconds))))


def queue_wait_s(stats: dict) -> float:
    """Seconds until a slot frees, from an engine's ``stats()``."""
    requests = stats["waiting"] + stats["running"]
    return stats.get("backlog_s", 0.0) / requests if requests else 0.0


def session_wait_s(last_seen: list[tuple[bool, float]], grace_s: float, idle_s: float) -> float:
    """``last_seen``: (watched ever, monotonic time last watched or created) of each live
    session that no client watches now; watched ones end no sooner than ``idle_s``."""
    now = time.monotonic()
    ends = [(idle_s if connected else grace_s) - (now - seen) for connected, seen in last_seen]
    return min(ends, default=idle_s)


class RetryAfter:
    def __init__(self, app: ASGIApp, *, estimate: Callable[[str], float]) -> None:
        """``estimate(path)``: seconds a client refused on ``path`` should wait."""
        self.app, self.estimate = app, estimate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_retry_after(event: Message) -> None:  # an ASGI send event
            if event["type"] == "http.response.start" and event["status"] == 429:
                value = header_value(self.estimate(scope["path"])).encode()
                headers = [(k, v) for k, v in event.get("headers", []) if k.lower() != b"retry-after"]
                event = {**event, "headers": [*headers, (b"retry-after", value)]}
            await send(event)

        await self.app(scope, receive, with_retry_after)
