"""The weight plane over HTTP (admin routes, behind the API key when one is set):

* ``POST /v1/weights``: JSON ``{"path": "<file inside --weights-dir>", "version": "..."}`` or a
  multipart upload (``file``, ``version``); optional ``role`` (what the weights are: policy,
  ema, ...), ``component`` (default: the path's first folder when it names one, else
  ``transformer``) and ``running`` (``finish``: running requests end on the old weights;
  ``requeue``: they start over on the new ones). The accepted layout is the served model's
  files: ``transformer/*.safetensors`` with its checkpoint names (a state dict of our own
  module names works too). Answers with the new version once the swap is done. A path outside
  the directory is a 403; a bad tensor or an older version a 400 naming the field, and the
  server keeps serving the old weights.
* ``GET /v1/weights``: ``{"version", "role", "updated_at", "component"}``.
* ``POST /v1/sleep`` (``{"level": 1|2}``) and ``POST /v1/wake``, as vLLM names them: release the
  weights (level 1: the DiT/LM and KV caches; 2: everything) and restore them from the host copy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request

from omniloop.engine.weights import DEFAULT_ROLE, WeightPlane, WeightUpdateRefused
from omniloop.serve.body import read_body
from omniloop.serve.errors import ApiError
from omniloop.serve.state import ServeState, State, require_auth

router = APIRouter(prefix="/v1", tags=["weights"], dependencies=[Depends(require_auth)])

_UPDATE_FIELDS = {"path", "file", "version", "role", "component", "running"}


def _plane(state: ServeState) -> WeightPlane:
    plane = state.engine.weight_plane()
    if plane is None:
        raise ApiError(400, "model: this deployment (several models, or an SPMD pool) takes no weight updates or "
                       "sleep; serve one model on one device", param="model", code="unsupported")
    return plane


def _allowed_path(state: ServeState, path: Any) -> Path:
    """``path`` inside ``--weights-dir`` (symlinks resolved), else a 403."""
    root = state.config.weights_dir
    if not isinstance(path, str) or not path:
        raise ApiError(400, "path: pass the file's path inside the server's --weights-dir as a string", param="path",
                       code="invalid_value")
    if root is None:
        raise ApiError(403, "path: this server reads no weight files (started without --weights-dir); upload the "
                       "file (multipart field 'file') instead", param="path", code="path_not_allowed")
    base = root.resolve()
    full = (base / path).resolve()
    if not full.is_relative_to(base):
        raise ApiError(403, f"path: {path!r} is outside the server's weights directory; pass a file inside it",
                       param="path", code="path_not_allowed")
    if not full.is_file():
        raise ApiError(400, f"path: no file {path!r} in the server's weights directory", param="path",
                       code="not_found")
    return full


def _component(state: ServeState, path: str | None, given: Any) -> str:
    if given is not None:
        if not isinstance(given, str):
            raise ApiError(400, "component: pass a component name (e.g. 'transformer')", param="component",
                           code="invalid_value")
        return given
    head = Path(path).parts[0] if path and len(Path(path).parts) > 1 else None
    return head if head is not None and head in state.engine.engine.pipeline.components else "transformer"


@router.post("/weights", summary="Swap in new weights (JSON: path inside --weights-dir; multipart: file) as a version")
async def update_weights(request: Request, state: State) -> dict[str, Any]:
    plane = _plane(state)
    fields, files = await read_body(request, state.config.max_upload_bytes, file_fields=("file",))
    unknown = sorted(set(fields) - _UPDATE_FIELDS)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field; pass path (or a multipart file), version and optionally "
                       "role, component, running", param=unknown[0], code="invalid_value")
    if "version" not in fields:
        raise ApiError(400, "version: pass the new weights' version (a string newer than the current "
                       f"{plane.version!r})", param="version", code="missing")
    if ("path" in fields) == ("file" in files):
        raise ApiError(400, "path: pass exactly one of 'path' (a file inside --weights-dir, JSON) or 'file' (a "
                       "multipart upload)", param="path", code="invalid_value")
    path = fields.get("path")
    component = _component(state, path, fields.get("component"))
    role = fields.get("role", DEFAULT_ROLE)
    if not isinstance(role, str) or not role:
        raise ApiError(400, "role: pass what the weights are, e.g. 'policy' or 'ema'", param="role",
                       code="invalid_value")
    running = fields.get("running", "finish")
    with tempfile.TemporaryDirectory(prefix="omniloop-weights-") as tmp:
        if path is not None:
            source, shown = _allowed_path(state, path), str(path)
        else:
            source, shown = Path(tmp) / "upload.safetensors", "the uploaded file"
            source.write_bytes(files["file"])
        try:
            info = await state.engine.update_weights(source, fields["version"], role=role, component=component,
                                                     running=running)
        except WeightUpdateRefused as e:  # nothing changed: the server serves the old weights
            detail = e.detail.replace(str(source), shown).replace(source.name, shown)  # server paths stay private
            param = "file" if e.field == "source" and path is None else "path" if e.field == "source" else e.field
            raise ApiError(400, f"{param}: {detail}", param=param, code="invalid_weights") from None
    return {**info.to_dict(), "copied_tensors": info.copied_tensors, "seconds": info.seconds}


@router.get("/weights", summary="The weights served: version, role, when they were swapped in")
async def get_weights(state: State) -> dict[str, Any]:
    plane = _plane(state)
    return {**plane.info.to_dict(), "asleep": plane.asleep}


@router.post("/sleep", summary="Release weights (level 1: DiT/LM and KV caches; 2: everything)")
async def sleep(request: Request, state: State) -> dict[str, Any]:
    _plane(state)
    has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
    fields, _ = await read_body(request, state.config.max_upload_bytes) if has_body else ({}, {})
    level = fields.get("level", 1)
    try:
        report = await state.engine.sleep(level, running=fields.get("running", "finish"))
    except WeightUpdateRefused as e:
        raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
    return report.to_dict()


@router.post("/wake", summary="Restore what /v1/sleep released")
async def wake(state: State) -> dict[str, Any]:
    plane = _plane(state)
    report = await state.engine.wake()
    return {**report.to_dict(), "version": plane.version}
