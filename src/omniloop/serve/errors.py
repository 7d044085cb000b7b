"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every bad input becomes a 4xx whose ``param`` and message name the field; engine
rejections keep their own status and message (RequestRejected and LimitExceeded 400,
DoesNotFit 413, QueueFull 429) and a dead engine is a 503. Nothing a client sends
reaches the catch-all 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from omniloop.engine import EngineDeadError, LimitExceeded, QueueFull, RequestRejected, UnknownRequest
from omniloop.serve.wire import WireError, describe_validation, wire_param

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


def validation_error(error: ValidationError | RequestValidationError, prefix: str = "") -> ApiError:
    """One message listing every problem as ``field: what is wrong``; ``param`` is the first."""
    items = list(error.errors())
    if isinstance(error, RequestValidationError):  # FastAPI's location prefix is not a field
        items = [{**i, "loc": tuple(i.get("loc", ()))[1:]} if tuple(i.get("loc", ()))[:1] in
                 (("body",), ("query",), ("path",), ("header",)) else i for i in items]
    param, message = describe_validation(items, prefix=prefix)
    return ApiError(400, message, param=param, code="invalid_value")


_Body = TypeVar("_Body", bound=BaseModel)


def parse_body(model: type[_Body], data: Any) -> _Body:
    """``model`` validated from a request body; a 400 naming every bad field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def api_error(error: Exception, names: Mapping[str, str] | None = None) -> ApiError:
    """A refusal in its HTTP form: a wire problem (``WireError``) or an engine error raised at
    submit. An engine rejection keeps the engine's message (the one the offline API and the
    Dynamo worker give), prefixed with the wire field when the message does not name it;
    ``names`` (a WireCall's) spell request-plane fields as this caller sent them."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, WireError):
        return ApiError(error.status, str(error), param=error.param, code=error.code)
    if isinstance(error, EngineDeadError):
        return ApiError(503, f"engine stopped: {error}", code="engine_dead")
    if isinstance(error, QueueFull):
        return ApiError(429, str(error), code="queue_full", headers={"Retry-After": "1"})
    assert isinstance(error, RequestRejected), f"unexpected engine error {type(error).__name__}"
    message, param = str(error), wire_param(error, names or {})
    if param is not None and param.split(".")[0] not in message:
        message = f"{param}: {message}"
    code = "does_not_fit" if error.status_code == 413 else "limit_exceeded" if isinstance(error, LimitExceeded) \
        else "rejected"
    return ApiError(error.status_code, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(WireError)
    @app.exception_handler(RequestRejected)
    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

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
