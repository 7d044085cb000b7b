"""ComfyUI's web front end (the ``comfyui-frontend-package`` wheel) served at ``/comfy/`` over
our ComfyUI API: the editor's own routes (settings, user data, jobs) against a real server, and
the page itself in headless Chromium, which loads, draws its graph canvas, opens an official
template and queues it through ``/comfy/api/prompt`` to the engine."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omniloop.serve import comfy_frontend
from omniloop.workflows.ui_format import ui_to_api
from tests.serve.conftest import live_server
from tests.workflows.templates import loaded_files, template

pytest.importorskip("comfyui_frontend_package")
pytest.importorskip("comfyui_workflow_templates_json")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TEMPLATE = "flux_schnell"


@pytest.fixture(scope="module")
def server(flux_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("comfy_models")
    files = {f"{kind}/{name}": "flux" for kind, name in loaded_files(ui_to_api(template(TEMPLATE)))}
    (folder / "omniloop-models.json").write_text(json.dumps({"served": {"flux": {"path": str(flux_dir)}},
                                                             "files": files}))
    limits = {"max_steps": 50, "max_pixels": 64 * 64, "max_images": 2}
    with live_server(flux_dir, limits=limits, serve={"comfy_models": folder,
                                                     "comfy_workdir": tmp_path_factory.mktemp("comfy_work")}) as s:
        yield s


def test_without_the_package_comfy_is_a_404_naming_it(monkeypatch):
    from omniloop.serve.comfy import router, ws_router

    monkeypatch.setattr(comfy_frontend, "frontend_dist", lambda: None)
    app = FastAPI()
    comfy_frontend.install(app, router, ws_router, Path("/nonexistent"))
    client = TestClient(app)
    for path in ("/comfy", "/comfy/", "/comfy/assets/x.js"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 404 and "pip install comfyui-frontend-package" in r.json()["error"], path


def test_the_page_and_the_editor_routes(server):
    url = f"{server.url}/comfy"
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200 and "<title>ComfyUI</title>" in page.text
    assert httpx.get(url, timeout=30, follow_redirects=False).headers["location"] == "/comfy/"
    assert httpx.get(f"{url}/api/users", timeout=30).json() == {"storage": "server", "migrated": True}
    # settings persist (as the editor posts them: a JSON body, here with the text/plain type it uses)
    same_origin = {"origin": server.url, "content-type": "text/plain;charset=UTF-8"}
    assert httpx.post(f"{url}/api/settings/Comfy.Locale", content='"en"', headers=same_origin).status_code == 200
    assert httpx.post(f"{url}/api/settings", json={"Comfy.Theme": "dark"}).status_code == 200
    assert httpx.get(f"{url}/api/settings").json() == {"Comfy.Locale": "en", "Comfy.Theme": "dark"}
    assert httpx.get(f"{url}/api/settings/Comfy.Theme").json() == "dark"
    other = httpx.post(f"{url}/api/settings/x", content="1", headers={**same_origin, "origin": "http://evil.example"})
    assert other.status_code == 403  # a page of another origin still cannot
    # user data: saved workflows
    r = httpx.post(f"{url}/api/userdata/workflows%2Fa.json?overwrite=false&full_info=true", content=b'{"n": 1}')
    assert r.status_code == 200 and r.json()["path"] == "workflows/a.json" and r.json()["size"] == 8
    assert httpx.post(f"{url}/api/userdata/workflows%2Fa.json?overwrite=false", content=b"{}").status_code == 409
    assert httpx.get(f"{url}/api/userdata/workflows%2Fa.json").json() == {"n": 1}
    listed = httpx.get(f"{url}/api/userdata", params={"dir": "workflows", "recurse": "true", "full_info": "true"})
    assert [f["path"] for f in listed.json()] == ["a.json"]
    moved = httpx.post(f"{url}/api/userdata/workflows%2Fa.json/move/workflows%2Fb.json")
    assert moved.json() == "workflows/b.json"
    assert httpx.get(f"{url}/api/userdata", params={"dir": "workflows"}).json() == ["b.json"]
    assert httpx.delete(f"{url}/api/userdata/workflows%2Fb.json").status_code == 204
    assert httpx.get(f"{url}/api/userdata/workflows%2Fb.json").status_code == 404
    assert httpx.get(f"{url}/api/userdata/..%2F..%2Fetc%2Fpasswd").status_code == 403
    assert httpx.get(f"{url}/api/userdata", params={"dir": "nope"}).status_code == 404
    # the API aliases and the refusal of what is not served
    assert "CheckpointLoaderSimple" in httpx.get(f"{url}/api/object_info", timeout=30).json()
    assert httpx.get(f"{url}/api/queue").json() == {"queue_running": [], "queue_pending": []}
    assert all(e.startswith("/extensions/core/") for e in httpx.get(f"{url}/api/extensions").json())
    assert httpx.get(f"{url}/api/jobs", params={"status": "bogus"}).status_code == 400
    assert httpx.post(f"{url}/api/jobs/nope/cancel").status_code == 404
    assert httpx.post(f"{url}/api/jobs/cancel", json={"job_ids": "x"}).status_code == 400
    missing = httpx.get(f"{url}/api/internal/logs")
    assert missing.status_code == 404 and "not served by omniloop" in missing.json()["error"]
    assert httpx.get(f"{url}/templates/index.json").status_code == 200


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _small_template() -> dict[str, Any]:
    """The template as a user would shrink it in the editor: 32x32, 2 steps, a fixed seed."""
    workflow = template(TEMPLATE)
    for node in workflow["nodes"]:
        if node["type"] == "EmptySD3LatentImage":
            node["widgets_values"][:2] = [32, 32]
        if node["type"] == "KSampler":
            node["widgets_values"][:3] = [7, "fixed", 2]
    return workflow


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
def test_the_front_end_loads_and_queues_a_template_in_headless_chromium(server):
    driver = _browser()
    try:
        driver.get(f"{server.url}/comfy/")
        deadline = time.monotonic() + 90
        while not driver.execute_script("return !!(window.app && window.app.graph && "
                                        "document.querySelector('canvas#graph-canvas'));"):
            assert time.monotonic() < deadline, "the editor's graph canvas never appeared"
            time.sleep(0.25)
        # open the official template in the editor and press Queue (app.queuePrompt), as a user would
        nodes = driver.execute_async_script(
            "const [wf, done] = arguments; window.app.loadGraphData(wf).then(() => window.app.queuePrompt(0, 1))"
            ".then(() => done(window.app.graph._nodes.length), e => done(String(e)));", _small_template())
        assert nodes == len(_small_template()["nodes"]), nodes
        deadline = time.monotonic() + 120
        while not (history := httpx.get(f"{server.url}/history", timeout=30).json()):
            assert time.monotonic() < deadline, "the queued prompt never finished"
            time.sleep(0.5)
        (item,) = history.values()
        assert item["status"]["status_str"] == "success", item["status"]
        (output,) = item["outputs"].values()
        (image,) = output["images"]
        view = httpx.get(f"{server.url}/comfy/api/view", params=image, timeout=30)
        assert view.status_code == 200 and view.content[:8] == b"\x89PNG\r\n\x1a\n"
        jobs = httpx.get(f"{server.url}/comfy/api/jobs", params={"status": "completed"}, timeout=30).json()
        assert [j["id"] for j in jobs["jobs"]] == list(history) and jobs["jobs"][0]["outputs_count"] == 1
    finally:
        driver.quit()
