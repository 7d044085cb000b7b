"""``create_app(engine, config)``: the FastAPI app of the OpenAI-compatible server.

Routes: the Videos API (``videos.py``), images (``images.py``), event streams
(``streaming.py``) and, here, ``/health``, ``/ready``, ``/v1/models``, ``/metrics``.
The lifespan starts the warmup (``/ready`` is 503 until it is done) and, on shutdown,
stops following jobs; draining on SIGTERM is ``server.py``'s.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

import omniloop
from omniloop.engine import AsyncEngine
from omniloop.request.builder import aliases_of
from omniloop.serve import audio, chat, images, loras, play, rollouts, sessions, streaming, videos, weights
from omniloop.serve.config import ServeConfig
from omniloop.serve.docs_pages import install_docs
from omniloop.serve.errors import install_error_handlers
from omniloop.serve.backpressure import RetryAfter, queue_wait_s
from omniloop.serve.browser import BrowserGuard, HostPolicy, OriginPolicy
from omniloop.serve.guards import BodyLimit
from omniloop.serve.idempotency import Idempotent
from omniloop.serve.jobs import JobStore
from omniloop.serve.protocol import (ImageEditRequest, ImageGenerationRequest, ImageVariationRequest, ModelCard,
                                     ModelList, VideoCreateRequest)
from omniloop.serve.state import ServeState, State, check_auth, require_auth

system = APIRouter(tags=["system"])


@system.get("/health", summary="Liveness: the process answers and the engine thread runs")
async def health(state: State) -> JSONResponse:
    alive = state.engine.stats()["alive"]
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)


@system.get("/ready", summary="Readiness: model loaded, warmed up, not draining")
async def ready(state: State) -> JSONResponse:
    ok, reason = state.readiness()
    return JSONResponse({"status": reason, "model": state.model.name}, status_code=200 if ok else 503)


@system.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_auth)])
async def models(state: State) -> ModelList:
    served = list(state.models.values())
    mgr = sessions.manager(state)
    if mgr.own_engine and mgr.model.name not in state.models:  # the interactive model beside (sessions, /play)
        served.append(mgr.model)
    return ModelList(data=[ModelCard(id=m.name, created=state.started_at, tasks=m.task_names,
                                     actions=sorted(m.defaults.actions) if m.defaults.actions is not None else None)
                           for m in served])


@system.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request, state: State) -> Response:
    if not state.config.metrics_public:
        check_auth(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# -- OpenAPI for the hand-read bodies ------------------------------------------------------

_BODIES: dict[str, type[BaseModel]] = {"VideoCreateRequest": VideoCreateRequest,
                                       "ImageGenerationRequest": ImageGenerationRequest,
                                       "ImageEditRequest": ImageEditRequest,
                                       "ImageVariationRequest": ImageVariationRequest,
                                       "SpeechRequest": audio.SpeechRequest}


def _multipart_schema(schema: dict[str, Any], file_fields: tuple[str, ...]) -> dict[str, Any]:
    """The multipart twin of a JSON body: each file field an uploaded file part.

    NOTE: a file part is spelled the OpenAPI 3.1 way (``contentMediaType:
    application/octet-stream``, which clients and Swagger UI read as a file), not 3.0's
    ``format: binary``: schemathesis (4.x) cannot judge a mutated body holding its ``Binary``
    values, so it made no negative case for a body with two file fields (issue 29)."""
    form = copy.deepcopy(schema)
    for name in file_fields:
        form["properties"][name] = {"type": "string", "contentMediaType": "application/octet-stream",
                                    "description": "an image file"}
    return form


def _this_server(body: dict[str, Any], state: ServeState) -> dict[str, Any]:
    """The deployment's ceilings as schema bounds, and an example that is known to work
    (the first warmup shape), so clients and fuzzers see what this server accepts."""
    ceilings = {"steps": state.limits.max_steps, "num_frames": state.limits.max_frames, "n": state.limits.max_images}
    ceilings |= {alias: ceilings[name] for alias, name in aliases_of(ceilings).items()}  # num_inference_steps
    for name, ceiling in ceilings.items():
        for variant in body["properties"].get(name, {}).get("anyOf", [body["properties"].get(name, {})]):
            if "maximum" in variant:
                variant["maximum"] = min(variant["maximum"], ceiling)
    if body.get("additionalProperties") is True:  # a generation body: its extra fields are the models' loop knobs
        for model in state.models.values():
            knobs, defs = model.knob_table().json_schema(ref_template="#/components/schemas/{model}")
            body.setdefault("$defs", {}).update(defs)
            body["properties"] = {**knobs, **body["properties"]}
        body["additionalProperties"] = False  # any other extra field is refused (400)
    if "loras" in body["properties"] and not any(m.takes_loras for m in state.models.values()):
        body["properties"]["loras"]["maxItems"] = 0  # no served model takes LoRAs
    if state.warmup_shapes and "prompt" in body["properties"]:  # (speech bodies take ``input``)
        shape, d = state.warmup_shapes[0], state.model.defaults
        example = {"prompt": "a red circle moving right", "steps": shape.num_steps(d.steps),
                   "size": f"{shape.width or d.width}x{shape.height or d.height}"}
        if "num_frames" in body["properties"]:
            example["num_frames"] = shape.num_frames or d.num_frames
        body["examples"] = [example]
    return body


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus request bodies of the operations that read theirs by hand
    (marked ``x-omniloop-body``): JSON, and multipart where the operation takes uploads."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model_name, model in _BODIES.items():
        body = _this_server(model.model_json_schema(ref_template="#/components/schemas/{model}"), app.state.omniloop)
        components.update(body.pop("$defs", {}))
        components[model_name] = body
    for path in schema["paths"].values():
        for op in path.values():
            doc = op.pop("x-omniloop-body", None)
            if doc is None:
                continue
            content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{doc['json']}"}}}
            if "multipart" in doc:
                components[doc["multipart"]] = _multipart_schema(components[doc["json"]], tuple(doc["file_fields"]))
                content["multipart/form-data"] = {"schema": {"$ref": f"#/components/schemas/{doc['multipart']}"}}
            op["requestBody"] = {"required": True, "content": content}
    app.openapi_schema = schema
    return schema


def create_app(engine: AsyncEngine, config: ServeConfig | None = None, *, jobs: JobStore | None = None,
               session_engine: AsyncEngine | None = None) -> FastAPI:
    """The server over ``engine`` (whose admission enforces the deploy config's limits).
    ``jobs``: an opened store (default: the one ``config`` asks for, opened here);
    ``session_engine``: an interactive model's engine that serves the sessions (and /play)."""
    state = ServeState(engine, config or ServeConfig(), jobs)
    if session_engine is not None:
        sessions.attach_session_engine(state, session_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            await sessions.manager(state).close()
            await state.close()

    app = FastAPI(title="omniloop", version=omniloop.__version__,
                  description="OpenAI-compatible video and image generation on the omniloop engine",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    install_docs(app)  # /docs and /redoc with their assets served from the package, not a CDN
    app.state.omniloop = state
    install_error_handlers(app)
    for router in (system, videos.router, streaming.router, images.router, sessions.router,
                   chat.router, audio.router, loras.router, play.router, rollouts.router, weights.router):
        app.include_router(router)
    config = state.config
    if config.comfy_models is not None:  # ComfyUI's API beside the OpenAI one (serve/comfy.py)
        from omniloop.serve import comfy
        from omniloop.workflows import ModelFolder

        comfy.install(app, state, ModelFolder.load(config.comfy_models), config.comfy_workdir)
    app.add_middleware(Idempotent)  # inside the body cap: it reads the (capped) body to key a retry
    app.add_middleware(BodyLimit, max_bytes=config.max_upload_bytes, max_json_depth=config.max_json_depth,
                       max_ws_message_bytes=config.max_ws_message_bytes)
    app.add_middleware(RetryAfter, estimate=lambda path: sessions.manager(state).retry_after_s()
                       if path.startswith("/v1/sessions") else queue_wait_s(state.engine.stats()))
    if config.allowed_origins:  # preflights and Access-Control-Allow-Origin for the pages allowed to call
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_credentials="*" not in
                           config.allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "Idempotency-Key"], max_age=600)
    app.add_middleware(BrowserGuard, hosts=HostPolicy(config.host, config.allowed_hosts),  # outermost: refuse first
                       origins=OriginPolicy(config.allowed_origins))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
