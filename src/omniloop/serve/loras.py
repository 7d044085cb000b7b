"""``/v1/loras``: the LoRA adapters of the served models, loaded and unloaded while serving.

* ``GET /v1/loras`` (``?model=``): every registered adapter, with its tiers and users.
* ``POST /v1/loras``: multipart ``name`` + the safetensors ``file`` (diffusers/peft or kohya
  layout), optional ``model``. The file is checked against the model before anything
  changes: keys that match nothing are a 400 naming them, and the server keeps serving.
  File paths are never read on a client's behalf (the deploy config's ``lora_files``
  names files on the server's disk).
* ``DELETE /v1/loras/{name}`` (``?model=``): new requests can no longer name it; running
  ones keep it until they end, and then its uploaded file is removed from disk.

Registrations are capped per model: ``ServeConfig.max_loras`` adapters and
``max_lora_bytes`` of their files (409 beyond: delete one first).

Requests then name adapters in ``loras: [{"name": ..., "strength": ...}]``. The registry is
the pipeline's ``AdapterCache`` (``cache/adapters.py``: device and host tiers, LRU, byte
budgets); its load is thread-safe against the engine thread's forwards.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from omniloop.cache.adapters import AdapterCache
from omniloop.engine.model_pool import ModelPool
from omniloop.engine.pool import PoolEngine
from omniloop.pipeline.adapters import adapter_cache
from omniloop.serve.body import read_body
from omniloop.serve.errors import ApiError
from omniloop.serve.state import ServeState, State, require_auth
from omniloop.serve.wire import ServedModel

router = APIRouter(prefix="/v1/loras", tags=["loras"], dependencies=[Depends(require_auth)])

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LoraObject(BaseModel):
    id: str  # the name requests pass
    object: Literal["lora"] = "lora"
    model: str
    bytes: int
    components: list[str]  # what it patches: transformer, text encoders
    device_resident: bool
    host_resident: bool
    in_use: int  # running requests holding it


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraObject]


class LoraDeleted(BaseModel):
    id: str
    object: Literal["lora"] = "lora"
    deleted: bool = True


def _cache(state: ServeState, model: ServedModel) -> AdapterCache:
    engine = state.engine.engine
    if isinstance(engine, PoolEngine):  # a file loaded here would patch rank 0's modules only
        raise ApiError(400, "name: an SPMD deployment loads LoRAs at startup only (deploy config lora_files)",
                       param="name", code="unsupported")
    pipeline = engine.pipelines()[model.route] if isinstance(engine, ModelPool) and model.route else engine.pipeline
    cache = adapter_cache(pipeline.caches)
    if cache is None:
        raise ApiError(400, f"model: {model.name!r} takes no LoRAs", param="model", code="unsupported")
    return cache


def _object(info: dict[str, Any], model: ServedModel) -> LoraObject:
    return LoraObject(id=info["name"], model=model.name, bytes=info["bytes"], components=info["components"],
                      device_resident=info["device_resident"], host_resident=info["host_resident"],
                      in_use=info["in_use"])


def _upload_dir(state: ServeState) -> Path:
    """Uploaded files live as long as the server (an adapter evicted from host memory is
    read again from its file); removed at shutdown."""
    if state.lora_upload_dir is None:
        path = Path(tempfile.mkdtemp(prefix="omniloop-loras-"))
        state.lora_upload_dir = path
        state.on_close.append(lambda: shutil.rmtree(path, ignore_errors=True))
    return state.lora_upload_dir


def _check_room(state: ServeState, cache: AdapterCache, model: ServedModel, size: int) -> None:
    loaded = cache.list()
    if len(loaded) >= state.config.max_loras:
        raise ApiError(409, f"name: {len(loaded)} LoRAs are loaded on {model.name!r} (max_loras "
                       f"{state.config.max_loras}); DELETE /v1/loras/{{name}} one first", param="name",
                       code="too_many_loras")
    held = sum(info["bytes"] for info in loaded)
    if held + size > state.config.max_lora_bytes:
        raise ApiError(409, f"file: {size} more bytes would hold {held + size} of LoRAs on {model.name!r}, over "
                       f"max_lora_bytes {state.config.max_lora_bytes}; DELETE /v1/loras/{{name}} one first",
                       param="file", code="too_many_lora_bytes")


def _remove_upload(upload_dir: Path, source: str) -> None:
    """An unloaded adapter's file, once no request holds it -- only files uploaded here (the
    deploy config's ``lora_files`` are the operator's and stay)."""
    path = Path(source)
    if path.parent == upload_dir:
        path.unlink(missing_ok=True)


@router.get("", response_model=LoraList, summary="List the loaded LoRAs")
async def list_loras(state: State, model: str | None = Query(default=None)) -> LoraList:
    models = [state.served(model)] if model is not None else list(state.models.values())
    data = []
    for m in models:
        engine = state.engine.engine
        pipeline = engine.loaded_pipelines().get(m.route) if isinstance(engine, ModelPool) and m.route else engine.pipeline
        cache = adapter_cache(pipeline.caches) if pipeline is not None else None
        data += [_object(info, m) for info in (cache.list() if cache is not None else [])]
    return LoraList(data=data)


@router.post("", response_model=LoraObject, summary="Load a LoRA file (multipart: name, file[, model])")
async def load_lora(request: Request, state: State) -> LoraObject:
    fields, files = await read_body(request, state.config.max_upload_bytes, file_fields=("file",))
    unknown = sorted(set(fields) - {"name", "model"})
    if "path" in fields:
        raise ApiError(400, "path: file paths are never read on a client's behalf; upload the file (multipart "
                       "field 'file'), or list it in the deploy config's lora_files", param="path",
                       code="path_refused")
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field; pass name, file (multipart) and optionally model",
                       param=unknown[0], code="invalid_value")
    name = fields.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"name: {name!r} is not a LoRA name; pass 1-128 letters, digits, '.', '_' or '-'",
                       param="name", code="invalid_value")
    if "file" not in files:
        raise ApiError(400, "file: upload the LoRA's .safetensors file as the multipart field 'file'",
                       param="file", code="missing")
    model = state.served(fields.get("model"))
    cache = _cache(state, model)
    if name in cache:
        raise ApiError(409, f"name: a LoRA named {name!r} is already loaded on {model.name!r}; DELETE "
                       f"/v1/loras/{name} first or pick another name", param="name", code="conflict")
    _check_room(state, cache, model, len(files["file"]))
    upload_dir = _upload_dir(state)
    cache.on_drop = lambda _name, source: _remove_upload(upload_dir, source)
    path = upload_dir / f"{uuid.uuid4().hex}.safetensors"
    path.write_bytes(files["file"])
    try:
        info = await asyncio.to_thread(cache.load, name, path)
    except Exception as e:  # noqa: BLE001 - a bad file (wrong keys, not safetensors): the server keeps serving
        path.unlink(missing_ok=True)
        message = str(e).replace(str(path), "the uploaded file")  # the server's own paths stay private
        raise ApiError(400, f"file: {message}", param="file", code="invalid_lora") from None
    return _object(info, model)


@router.delete("/{name}", response_model=LoraDeleted, summary="Unload a LoRA")
async def unload_lora(name: str, state: State, model: str | None = Query(default=None)) -> LoraDeleted:
    served = state.served(model)
    cache = _cache(state, served)
    if name not in cache:
        raise ApiError(404, f"no LoRA {name!r} is loaded on {served.name!r}; loaded: {cache.names()}",
                       param="name", code="not_found")
    cache.unload(name)
    return LoraDeleted(id=name)
