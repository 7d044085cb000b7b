"""ComfyUI's web front end at ``/comfy/``, served from the ``comfyui-frontend-package`` wheel.

The front end computes its API base from the page's path (``/comfy/index.html`` -> ``/comfy``),
so it calls ``/comfy/api/<route>`` and opens the WebSocket ``/comfy/ws``. Those are ComfyUI's
API of ``serve/comfy.py`` mounted again under that prefix, plus the routes the editor itself
needs to load, backed by real state:

- ``/users``, ``/settings[/{id}]``, ``/userdata[/{file}]`` (list, read, write, delete, move): the
  single user's settings and saved workflows, files under ``<comfy workdir>/user/default/``
  as ComfyUI keeps them; names leaving that folder are refused (403);
- ``/extensions``: the package's own core extensions (we run no custom nodes), and
  ``/i18n``, ``/workflow_templates``, ``/global_subgraphs``: the empty answers of a ComfyUI
  without custom nodes;
- ``/experiment/models[/{folder}]``: the model folder's files (the model library);
- ``/jobs[/{id}]`` (and ``POST /jobs[/{id}]/cancel``): the prompts as ComfyUI's jobs API lists them;
- ``/features``: what this server supports (no preview metadata).

Anything else under ``/comfy/api/`` is a 404 naming the route and what is served instead.
Without the package installed, ``/comfy/`` is a 404 saying which package to install.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from omniloop.serve.state import require_auth

if TYPE_CHECKING:
    from omniloop.serve.comfy import PromptJob

PACKAGE = "comfyui-frontend-package"
PREFIX = "/comfy"
API = f"{PREFIX}/api"
SETTINGS_FILE = "comfy.settings.json"
router = APIRouter(prefix=API, tags=["comfyui front end"], dependencies=[Depends(require_auth)])


def frontend_dist() -> Path | None:
    """The front end's built files (``index.html`` and ``assets/``), or None without the package."""
    spec = importlib.util.find_spec("comfyui_frontend_package")
    if spec is None or spec.origin is None:
        return None
    static = Path(spec.origin).parent / "static"
    return static if (static / "index.html").is_file() else None


def workflow_templates_dir() -> Path | None:
    """The official workflow templates (``index.json`` and one JSON per template) of the
    ``comfyui-workflow-templates-json`` package, when installed."""
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "templates"
    return folder if (folder / "index.json").is_file() else None


class UserFiles:
    """The one user's data folder (``user/default/`` of the ComfyUI workdir); every name
    resolved inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for folder in ("workflows", "subgraphs"):  # what the editor lists on load
            (self.root / folder).mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path | None:
        """``name`` (``/``-separated, as the front end URL-encodes it) inside the folder, or
        None when it would leave it."""
        if not name or name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
            return None
        path = (self.root / name).resolve()
        return path if path.is_relative_to(self.root.resolve()) else None

    def info(self, path: Path, base: Path | None = None) -> dict[str, Any]:
        stat = path.stat()
        return {"path": path.relative_to(base or self.root.resolve()).as_posix(), "size": stat.st_size,
                "modified": stat.st_mtime, "created": stat.st_ctime}

    def settings(self) -> dict[str, Any]:
        path = self.root / SETTINGS_FILE
        if not path.is_file():
            return {}
        try:
            settings = json.loads(path.read_text())
        except ValueError:
            return {}  # a corrupt file reads as no settings (ComfyUI does the same), the next save rewrites it
        return settings if isinstance(settings, dict) else {}

    def save_settings(self, settings: dict[str, Any]) -> None:
        (self.root / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))


def _files(request: Request) -> UserFiles:
    return request.app.state.comfy_user


def _refused(name: str) -> Response:
    return Response(f"{name!r} leaves the user folder: pass a relative name without '..'", status_code=403)


def _user_file(files: UserFiles, name: str) -> Path | Response:
    """The existing user-data file ``name``, or the answer refusing it: 403 when the name leaves the
    user folder, 404 when no such file is there."""
    path = files.path(name)
    if path is None:
        return _refused(name)
    if not path.is_file():
        return Response(f"no file {name!r} in the user data", status_code=404)
    return path


@router.get("/users")
async def users(request: Request) -> dict[str, Any]:
    # single-user: the front end then uses the default user's server-side storage
    return {"storage": "server", "migrated": True}


@router.get("/settings")
async def settings(request: Request) -> dict[str, Any]:
    return _files(request).settings()


@router.get("/settings/{setting_id}")
async def setting(request: Request, setting_id: str) -> Any:
    return _files(request).settings().get(setting_id)


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        return None


@router.post("/settings")
async def post_settings(request: Request) -> Response:
    body = await _json(request)
    if not isinstance(body, dict):
        return JSONResponse({"error": "settings: send a JSON object {\"<setting id>\": value}"}, status_code=400)
    files = _files(request)
    files.save_settings({**files.settings(), **body})
    return Response(status_code=200)


@router.post("/settings/{setting_id}")
async def post_setting(request: Request, setting_id: str) -> Response:
    raw = await request.body()
    try:
        value = json.loads(raw)
    except ValueError:
        return JSONResponse({"error": f"settings/{setting_id}: the body must be a JSON value"}, status_code=400)
    files = _files(request)
    files.save_settings({**files.settings(), setting_id: value})
    return Response(status_code=200)


@router.get("/userdata")
async def list_userdata(request: Request, dir: str = "", recurse: str = "", full_info: str = "",
                        split: str = "") -> Any:
    if not dir:
        return Response("pass the folder to list as ?dir=", status_code=400)
    files = _files(request)
    folder = files.path(dir)
    if folder is None:
        return _refused(dir)
    if not folder.is_dir():
        return Response(f"no folder {dir!r} in the user data", status_code=404)
    found = sorted(p for p in (folder.rglob("*") if recurse.lower() == "true" else folder.glob("*")) if p.is_file())
    if full_info.lower() == "true":
        return [files.info(p, folder) for p in found]
    names = [p.relative_to(folder).as_posix() for p in found]
    return [[n, *n.split("/")] for n in names] if split.lower() == "true" else names


@router.get("/userdata/{name:path}")
async def get_userdata(request: Request, name: str) -> Response:
    path = _user_file(_files(request), name)
    return path if isinstance(path, Response) else FileResponse(path)


@router.post("/userdata/{name:path}")
async def post_userdata(request: Request, name: str, overwrite: str = "true", full_info: str = "false") -> Any:
    files = _files(request)
    if "/move/" in name:  # POST /userdata/{file}/move/{dest}
        source, _, dest = name.partition("/move/")
        return _move(files, source, dest, overwrite != "false", full_info.lower() == "true")
    path = files.path(name)
    if path is None:
        return _refused(name)
    if overwrite == "false" and path.exists():
        return Response(f"{name!r} exists: pass overwrite=true to replace it", status_code=409)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(await request.body())
    return files.info(path) if full_info.lower() == "true" else path.relative_to(files.root.resolve()).as_posix()


def _move(files: UserFiles, source: str, dest: str, overwrite: bool, full_info: bool) -> Any:
    src, dst = files.path(source), files.path(dest)
    if src is None or dst is None:
        return _refused(source if src is None else dest)
    if not src.is_file():
        return Response(f"no file {source!r} in the user data", status_code=404)
    if not overwrite and dst.exists():
        return Response(f"{dest!r} exists: pass overwrite=true to replace it", status_code=409)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(src, dst)
    return files.info(dst) if full_info else dst.relative_to(files.root.resolve()).as_posix()


@router.delete("/userdata/{name:path}")
async def delete_userdata(request: Request, name: str) -> Response:
    path = _user_file(_files(request), name)
    if isinstance(path, Response):
        return path
    path.unlink()
    return Response(status_code=204)


@router.get("/extensions")
async def extensions(request: Request) -> list[str]:
    """The front end's own extension scripts (paths from its root); no custom nodes here."""
    dist: Path = request.app.state.comfy_frontend
    return sorted("/" + p.relative_to(dist).as_posix() for p in (dist / "extensions").rglob("*.js"))


# ComfyUI's job statuses (the front end also filters on ``cancelled``: our interrupted prompts)
JOB_STATUS = {"pending": "pending", "running": "in_progress", "success": "completed", "error": "failed",
              "interrupted": "cancelled"}


def _job(job: PromptJob, full: bool = False) -> dict[str, Any]:
    """One prompt as ComfyUI's jobs API lists it (``full``: with its outputs and workflow)."""
    times = {kind: data.get("timestamp") for kind, data in job.messages}
    error = next((data for kind, data in job.messages if kind == "execution_error"), None)
    items = [(node, media, item) for node, out in job.outputs.items() for media, listed in out.items()
             if media != "animated" for item in listed]
    preview = next(({**item, "nodeId": node, "mediaType": media} for node, media, item in items), None)
    entry = {"id": job.id, "status": JOB_STATUS[job.status], "priority": job.number, "create_time": job.created_ms,
             "execution_start_time": times.get("execution_start"),
             "execution_end_time": next((times[k] for k in ("execution_success", "execution_error",
                                                             "execution_interrupted") if k in times), None),
             "execution_error": error, "outputs_count": len(items), "preview_output": preview,
             "workflow_id": ((job.extra_data.get("extra_pnginfo") or {}).get("workflow") or {}).get("id")}
    entry = {k: v for k, v in entry.items() if v is not None}
    if full:
        entry.update(outputs=job.outputs, workflow={"prompt": job.prompt, "extra_data": job.extra_data})
    return entry


@router.get("/jobs")
async def jobs(request: Request, status: str = "", sort_order: str = "desc", limit: int | None = None,
               offset: int = 0) -> Any:
    """The prompts, newest first (``status``: a comma list of pending, in_progress, completed,
    failed, cancelled)."""
    from omniloop.serve.comfy import api

    wanted = [s.strip() for s in status.split(",") if s.strip()] or list(JOB_STATUS.values())
    unknown = sorted(set(wanted) - set(JOB_STATUS.values()))
    if unknown or sort_order not in ("asc", "desc") or (limit is not None and limit <= 0):
        return JSONResponse({"error": f"status {unknown} / sort_order {sort_order!r} / limit {limit}: pass statuses "
                                      f"of {list(JOB_STATUS.values())}, sort_order asc or desc, a positive limit"},
                            status_code=400)
    listed = [_job(j) for j in api(request).jobs.values() if JOB_STATUS[j.status] in wanted]
    listed.sort(key=lambda j: j["create_time"], reverse=sort_order == "desc")
    offset = max(0, offset)
    page = listed[offset:offset + limit if limit is not None else None]
    return {"jobs": page, "pagination": {"offset": offset, "limit": limit, "total": len(listed),
                                         "has_more": offset + len(page) < len(listed)}}


@router.get("/jobs/{job_id}")
async def job(request: Request, job_id: str) -> Any:
    from omniloop.serve.comfy import api

    found = api(request).jobs.get(job_id)
    if found is None:
        return JSONResponse({"error": f"no job {job_id!r}"}, status_code=404)
    return _job(found, full=True)


@router.post("/jobs/cancel")
async def cancel_jobs(request: Request) -> Response:
    """``{"job_ids": [...]}``: stop each pending or running prompt named (unknown ids: 404)."""
    from omniloop.serve.comfy import api

    comfy, body = api(request), await _json(request)
    ids = body.get("job_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return JSONResponse({"error": "send {\"job_ids\": [\"<prompt id>\", ...]}"}, status_code=400)
    unknown = [i for i in ids if i not in comfy.jobs]
    if unknown:
        return JSONResponse({"error": f"no jobs {unknown}"}, status_code=404)
    for job_id in ids:
        await comfy.interrupt(job_id)
    return Response(status_code=200)


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(request: Request, job_id: str) -> Response:
    from omniloop.serve.comfy import api

    comfy = api(request)
    if job_id not in comfy.jobs:
        return JSONResponse({"error": f"no job {job_id!r}"}, status_code=404)
    await comfy.interrupt(job_id)
    return Response(status_code=200)


@router.get("/features")
async def features(request: Request) -> dict[str, Any]:
    limit = request.app.state.omniloop.config.max_upload_bytes
    return {"supports_preview_metadata": False, "max_upload_size": limit}


@router.get("/i18n")
async def i18n(request: Request) -> dict[str, Any]:
    return {}  # translations of custom nodes: none


@router.get("/workflow_templates")
async def workflow_templates(request: Request) -> dict[str, Any]:
    return {}  # custom nodes' example workflows: none


@router.get("/global_subgraphs")
async def global_subgraphs(request: Request) -> dict[str, Any]:
    return {}  # custom nodes' subgraph blueprints: none


@router.get("/experiment/models")
async def model_library(request: Request) -> list[dict[str, Any]]:
    """The model folders the library lists (ComfyUI: ``{name, folders}`` per folder kind)."""
    from omniloop.serve.comfy import api, model_folders

    root = api(request).folder.root
    return [{"name": kind, "folders": [str(root / kind)] if root else []} for kind in await model_folders(request)]


@router.get("/experiment/models/{folder}")
async def model_library_folder(request: Request, folder: str) -> Any:
    from omniloop.serve.comfy import models_in

    names = await models_in(request, folder)
    return names if isinstance(names, Response) else [{"name": n, "pathIndex": 0} for n in names]


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def not_served(request: Request, rest: str) -> JSONResponse:
    return JSONResponse({"error": f"{request.method} /api/{rest} is not served by omniloop's ComfyUI API; "
                                  "see docs/comfyui.md for the routes that are"}, status_code=404)


def missing(request: Request) -> JSONResponse:
    return JSONResponse({"error": f"the ComfyUI front end is not installed: pip install {PACKAGE} "
                                  "(or omniloop[comfyui]); ComfyUI's API itself is served at /prompt, /ws, ..."},
                        status_code=404)


def install(app: FastAPI, comfy_router: APIRouter, comfy_ws_router: APIRouter, user_dir: Path) -> None:
    """``/comfy/``: the front end's files, ComfyUI's API under ``/comfy/api`` (and its socket at
    ``/comfy/ws``) and the editor's own routes; a 404 naming the package when it is missing."""
    dist = frontend_dist()
    if dist is None:
        app.add_api_route(PREFIX, missing, include_in_schema=False)
        app.add_api_route(PREFIX + "/{rest:path}", missing, include_in_schema=False)
        return
    app.state.comfy_frontend = dist
    app.state.comfy_user = UserFiles(user_dir)
    app.include_router(comfy_router, prefix=API, include_in_schema=False)
    app.include_router(comfy_ws_router, prefix=PREFIX)
    app.include_router(router)
    app.add_api_route(PREFIX, lambda: RedirectResponse(PREFIX + "/"), include_in_schema=False)
    templates = workflow_templates_dir()
    if templates is not None:  # the template browser's index and workflows (the test extra has them)
        app.mount(PREFIX + "/templates", StaticFiles(directory=templates), name="comfy-templates")
    # index.html and the assets (after the routes above, which take precedence)
    app.mount(PREFIX, StaticFiles(directory=dist, html=True), name="comfy-frontend")


__all__ = ["PACKAGE", "frontend_dist", "install"]
