"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every bad input becomes a 4xx whose ``param`` and message name the field; engine
rejections keep their own status (RequestRejected 400, DoesNotFit 413, QueueFull 429)
and a dead engine is a 503. Nothing a client sends reaches the catch-all 500.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from omniloop.engine import EngineDeadError, QueueFull, RequestRejected, UnknownRequest

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = _TYPES.get(self.status, "error")
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


_TYPE_TAGS = {"float", "int", "str", "bool", "dict", "list", "bytes", "none", "literal"}


def validation_error(error: ValidationError | RequestValidationError, prefix: str = "") -> ApiError:
    """One message listing every problem as ``field: what is wrong``; ``param`` is the first."""
    problems, first = [], None
    for item in error.errors():
        # union members appear in loc as type tags ("float", "dict[...]"): not field names
        loc = [str(p) for p in item.get("loc", ()) if str(p) not in _TYPE_TAGS and "[" not in str(p)]
        if isinstance(error, RequestValidationError) and loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]  # FastAPI's location prefix
        field = ".".join(([prefix] if prefix else []) + loc) or "body"
        first = first or field
        msg = item.get("msg", "invalid")
        if item.get("type") == "extra_forbidden":
            msg = "unknown field; see /openapi.json for the accepted ones"
        problems.append(f"{field}: {msg}")
    return ApiError(400, "; ".join(problems), param=first, code="invalid_value")


# The engine names request-plane fields (``diffusion.height``); the wire names differ.
_WIRE_FIELD = {"height": "size", "width": "size"}


def engine_rejection(error: Exception, fields: dict[str, str] | None = None) -> ApiError:
    """Map an engine error raised at submit to its HTTP form. ``fields`` renames
    request-plane fields to the wire fields this endpoint accepts."""
    if isinstance(error, EngineDeadError):
        return ApiError(503, f"engine stopped: {error}", code="engine_dead")
    if isinstance(error, QueueFull):
        return ApiError(429, str(error), code="queue_full", headers={"Retry-After": "1"})
    assert isinstance(error, RequestRejected), f"unexpected engine error {type(error).__name__}"
    message = str(error)
    match = re.search(r"diffusion\.(\w+)", message)
    param = None
    if match:
        param = {**_WIRE_FIELD, **(fields or {})}.get(match.group(1), match.group(1))
    elif message.startswith("task ") or "needs an image" in message or "cannot read image" in message:
        param = "input_reference"
    if param is not None:
        message = f"{param}: {message}"
    code = "does_not_fit" if error.status_code == 413 else "rejected"
    return ApiError(error.status_code, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(UnknownRequest)
    async def _unknown(request: Request, exc: UnknownRequest) -> JSONResponse:
        return ApiError(404, str(exc), code="not_found").response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
