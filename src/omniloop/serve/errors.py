"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every bad input becomes a 4xx whose ``param`` and message name the field; engine
rejections keep their message and get their status from their ``kind`` (limit_exceeded and
the field kinds 400, does_not_fit 413, queue_full and draining 429) and their ``param`` from
their ``fields``; a dead engine is a 503. Nothing a client sends reaches the catch-all 500.
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

from omniloop.engine import EngineDeadError, RequestRejected, UnknownRequest
from omniloop.request import ErrorKind, Failure, InvalidRequest, RequestStatus, field_problems, format_validation_error
from omniloop.request.builder import UNKNOWN_FIELD
from omniloop.serve.wire import WireError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """``fields``: the request-plane fields of the engine rejection behind it (none for a
    wire problem), for an endpoint that respells them."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.fields = fields

    def response(self) -> JSONResponse:
        kind = _TYPES.get(self.status, "error")
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def validation_error(error: ValidationError | RequestValidationError, prefix: str = "") -> ApiError:
    """One message listing every problem as ``field: what is wrong``; ``param`` is the first."""
    problems = field_problems(error, drop_location=isinstance(error, RequestValidationError))
    found = format_validation_error(problems, prefix=prefix, root=prefix or "body", messages=UNKNOWN_FIELD)
    return ApiError(400, found.message, param=found.first_field or "body", code="invalid_value")


_Body = TypeVar("_Body", bound=BaseModel)


def parse_body(model: type[_Body], data: Any) -> _Body:
    """``model`` validated from a request body; a 400 naming every bad field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# NOTE: every HTTP status and error code of a refusal or a failure comes from its kind,
# never from its message's text (tests/test_error_kinds.py greps that no front end reads one)
REJECTION_STATUS: dict[ErrorKind, tuple[int, str]] = {  # kind -> (HTTP status, error code); else 400 "rejected"
    ErrorKind.LIMIT_EXCEEDED: (400, "limit_exceeded"),
    ErrorKind.DOES_NOT_FIT: (413, "does_not_fit"),
    ErrorKind.QUEUE_FULL: (429, "queue_full"),
    ErrorKind.DRAINING: (429, "queue_full"),  # a draining server sheds load like a full one (retry elsewhere)
    ErrorKind.ASLEEP: (503, "asleep"),  # the weights are released (POST /v1/sleep, while_asleep: reject)
}
ASLEEP_RETRY_S = 5  # Retry-After of a request refused while asleep (a wake takes seconds, not a queue's drain)
FAILURE_STATUS: dict[ErrorKind, tuple[int, str]] = {  # a finished job's failure; else 500 "generation_failed"
    # NOTE: the engine's per-request NaN/Inf check: the request's own numbers (an extreme
    # guidance_scale or a tiny shift) made its latents overflow, not the server
    ErrorKind.NON_FINITE: (422, "non_finite"),
    ErrorKind.CANCELLED: (503, "cancelled"),  # e.g. a drain with drain=cancel
}

# request-plane field -> its OpenAI-style wire name where that differs from the field's own name
WIRE_NAMES = {
    "diffusion.height": "size", "diffusion.width": "size",
    "inputs": "input_reference",  # the reference image (or video) the wire request carries
    "inputs.last_frame": "last_image",  # the last frame of a first-last-frame video
    "inputs.video": "video", "inputs.mask": "mask", "inputs.reference": "reference_images",  # Wan VACE's controls
    "inputs.pose": "pose_video", "inputs.face": "face_video",  # Wan-Animate's driving videos
    # ... and its segment knobs (flat fields; the checks run before its node's schema)
    "node_params['denoise'].segment_frame_length": "segment_frame_length",
    "node_params['denoise'].prev_segment_conditioning_frames": "prev_segment_conditioning_frames",
    "task": "input_reference",  # the wire declares no task: the reference image's presence picks it
}
# one wire field that carries several request fields: an error on all of them is about it
WIRE_GROUPS = {"size": frozenset({"diffusion.height", "diffusion.width"})}


def field_name(path: str) -> str:
    """The name a request-plane path's own message uses for it, as a wire field would be
    named: ``diffusion.loras[0].name`` -> ``loras``, ``node_params['refine'].strength`` ->
    ``node_params``, ``sampling.max_tokens`` -> ``max_tokens``."""
    head, _, rest = path.partition(".")
    name = rest if head in ("diffusion", "sampling") and rest else path
    return name.split(".")[0].split("[")[0]


def wire_param(error: InvalidRequest, names: Mapping[str, str],
               wire_names: Mapping[str, str] = WIRE_NAMES) -> tuple[str | None, bool]:
    """(the wire field behind a rejection, whether its message already names that field).

    The rejection's ``fields`` as the caller spelled them (``names``: DiffusionParams field ->
    the wire name that set it), else their usual wire names on this endpoint (``wire_names``:
    request-plane path -> wire name; a path not there is named by ``field_name``)."""
    if not error.fields:
        return None, False
    # an input part the caller sent under its own field (/v1/videos keyframes[i])
    exact = next((p for p in error.fields if p.startswith("inputs[") and p in names), None)
    if exact is not None:
        return names[exact], False
    # a field the caller set, under the name it used; else the first field's usual wire name
    path, param = next(((p, names[field_name(p)]) for p in error.fields
                        if p.startswith("diffusion.") and field_name(p) in names), (None, None))
    if path is None or param is None:
        path = error.fields[0]
        param = wire_names.get(path) or wire_names.get(field_name(path)) or field_name(path)  # inputs[0] -> inputs
    # the message names its fields by their paths: it names ``param`` if that is the field's
    # own name, or a wire field carrying exactly the error's fields (``size``: height and width)
    return param, param == field_name(path) or WIRE_GROUPS.get(param) == frozenset(error.fields)


def api_error(error: Exception, names: Mapping[str, str] | None = None,
              wire_names: Mapping[str, str] = WIRE_NAMES) -> ApiError:
    """A refusal in its HTTP form: a wire problem (``WireError``) or an engine error raised at
    submit. An engine rejection keeps the engine's message (the one the offline API and the
    Dynamo worker give), prefixed with the wire field when the message does not name it;
    its kind picks the status and code, its ``fields`` the ``param``."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, WireError):
        return ApiError(error.status, str(error), param=error.param, code=error.code)
    if isinstance(error, EngineDeadError):
        return ApiError(503, f"engine stopped: {error}", code="engine_dead")
    assert isinstance(error, RequestRejected), f"unexpected engine error {type(error).__name__}"
    status, code = REJECTION_STATUS.get(error.kind, (400, "rejected"))
    if error.kind in (ErrorKind.QUEUE_FULL, ErrorKind.DRAINING, ErrorKind.ASLEEP):  # nothing wrong with it: retry
        return ApiError(status, str(error), code=code, headers={"Retry-After": str(ASLEEP_RETRY_S if error.kind is
                                                                                   ErrorKind.ASLEEP else 1)})
    param, named = wire_param(error, names or {}, wire_names)
    message = str(error) if param is None or named else f"{param}: {error}"
    return ApiError(status, message, param=param, code=code, fields=error.fields)


def failure_error(status: RequestStatus, failure: Failure | None, message: str,
                  hints: Mapping[ErrorKind, str] | None = None) -> ApiError:
    """A job that ended without its result, in its HTTP form: ``message`` (the endpoint's
    sentence), then "; " and the hint for its kind, if ``hints`` has one. A cancelled job may
    carry no failure (the server stopped following it)."""
    kind = ErrorKind.CANCELLED if status is RequestStatus.CANCELLED else None if failure is None else failure.kind
    http, code = (500, "generation_failed") if kind is None else FAILURE_STATUS.get(kind, (500, "generation_failed"))
    hint = None if kind is None else (hints or {}).get(kind)
    return ApiError(http, message if hint is None else f"{message}; {hint}", code=code)


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
