"""Browser-safe by default: what a web page the user visits can make this server do.

A page on another origin can send "simple" requests (form posts, ``text/plain``) without a
CORS preflight, and a DNS-rebinding page reaches a loopback server under its own host name.
``BrowserGuard`` (an ASGI middleware in front of every route) closes both:

- **Host**: the ``Host`` header must be an IP literal, ``localhost``, the bound address (a
  wildcard bind adds this machine's host names) or one of ``allowed_hosts`` (``*``: any);
  otherwise 400 (a rebinding page's name is none of these).
- **Origin**: a state-changing request (POST, PUT, PATCH, DELETE) or a WebSocket upgrade
  that carries an ``Origin`` is refused (403; a WebSocket: closed with 4403) unless the
  origin is this server's own (its host:port is the ``Host``) or one of ``allowed_origins``
  (``*``: any). Clients that are not browsers send no ``Origin`` and are unaffected.
- **Content type**: a browser request (it carries ``Origin`` or ``Sec-Fetch-Mode``) with a
  form-only content type (``application/x-www-form-urlencoded``, ``text/plain``) is a 415:
  JSON routes want ``application/json``, which a page can only send after a preflight.
  Multipart stays accepted where it is today (the openai client sends ``videos.create``
  that way), guarded by the Origin rule.
- **CORS**: origins in ``allowed_origins`` get preflights answered and
  ``Access-Control-Allow-Origin`` on responses (Starlette's ``CORSMiddleware``).

With an API key set, a browser page authenticates through ``BrowserTokens``: it presents the
key once (``POST /v1/browser-token`` with ``Authorization: Bearer <key>``) and gets a
short-lived HttpOnly, SameSite=Strict cookie that stands in for the key on requests and
WebSocket upgrades (browsers put no headers on a WebSocket) -- the key never goes in a URL.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import time
from urllib.parse import urlsplit

from omniloop.serve.guards import ASGIApp, Receive, Scope, Send, header, refuse

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORM_ONLY = frozenset({"application/x-www-form-urlencoded", "text/plain"})
WS_FORBIDDEN = 4403
# ComfyUI's web editor (served at /comfy/) posts its JSON with fetch's default text/plain type;
# under this prefix a page of this server's own origin (no other) may do so
TEXT_JSON_PREFIXES = ("/comfy/api/",)
TOKEN_COOKIE = "omniloop_token"


def _host_name(value: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` names this server answers (see the module docstring)."""

    def __init__(self, bound: str, allowed: list[str]) -> None:
        self.any = "*" in allowed
        self.names = {_host_name(h) for h in allowed} | {"localhost", _host_name(bound)}
        if bound in ("0.0.0.0", "::", ""):  # reachable under this machine's own names too
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def allows(self, host: str | None) -> bool:
        if self.any:
            return True
        name = _host_name(host or "")
        return _is_ip(name) or name in self.names


class OriginPolicy:
    def __init__(self, allowed: list[str]) -> None:
        self.any = "*" in allowed
        self.allowed = {o.rstrip("/").lower() for o in allowed}

    def allows(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any or origin in self.allowed:
            return True
        if origin == "null":  # sandboxed frames, file: pages
            return False
        return urlsplit(origin).netloc == (host or "").lower()  # same origin: a page this server served


class BrowserGuard:
    """The Host, Origin and content-type rules, as a pure ASGI middleware."""

    def __init__(self, app: ASGIApp, *, hosts: HostPolicy, origins: OriginPolicy) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":  # closed before accept: the client sees the refusal
            await send({"type": "websocket.close", "code": WS_FORBIDDEN, "reason": problem[1][:120]})
        else:
            status, message, param, code = problem
            await refuse(send, status, message, param=param, code=code)

    def _problem(self, scope: Scope) -> tuple[int, str, str, str] | None:
        host, origin = header(scope, b"host"), header(scope, b"origin")
        if not self.hosts.allows(host):
            return (400, f"host: {host!r} is not a name this server answers (DNS rebinding guard); pass "
                    "--allowed-hosts NAME to serve it", "host", "host_not_allowed")
        changes = scope["type"] == "websocket" or scope["method"] in STATE_CHANGING
        if changes and origin is not None and not self.origins.allows(origin, host):
            return (403, f"origin: requests from {origin!r} are refused (not this server's origin); pass "
                    "--allowed-origins ORIGIN to let that page call it", "origin", "origin_not_allowed")
        ctype = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
        browser = origin is not None or header(scope, b"sec-fetch-mode") is not None
        same_origin_text = origin is not None and scope["path"].startswith(TEXT_JSON_PREFIXES) \
            and ctype == "text/plain" and urlsplit(origin).netloc == (host or "").lower()
        if scope["type"] == "http" and browser and ctype in FORM_ONLY and not same_origin_text:
            return (415, f"content-type: {ctype!r} is not accepted from a browser; send application/json",
                    "content-type", "unsupported_media_type")
        return None


class BrowserTokens:
    """Short-lived tokens a browser holds in a cookie instead of the API key."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[str, float] = {}

    def issue(self) -> str:
        now = time.monotonic()
        self._expiry = {t: e for t, e in self._expiry.items() if e > now}  # forget expired ones
        token = secrets.token_urlsafe(32)
        self._expiry[token] = now + self.ttl_s
        return token

    def valid(self, token: str | None) -> bool:
        return token is not None and self._expiry.get(token, 0.0) > time.monotonic()
