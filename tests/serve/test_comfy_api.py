"""ComfyUI's HTTP/WebSocket API served beside the OpenAI one (``--comfy-models``), driven by
a hand-written client that follows ComfyUI's ``script_examples/websockets_api_example.py``
protocol (urllib + websocket-client) and by a ComfyUI client library from PyPI
(``comfy-api-simplified``)."""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniloop.workflows.ui_format import ui_to_api
from tests.serve.conftest import live_server
from tests.workflows.templates import loaded_files, template
from tests.workflows.test_run_templates import small

pytest.importorskip("comfyui_workflow_templates_json")
websocket = pytest.importorskip("websocket")

TEMPLATES = {"text_to_video_wan": "wan", "flux_schnell": "flux"}


def models_folder(root: Path, checkpoints: dict[str, Path]) -> Path:
    files = {f"{folder}/{name}": family for tpl, family in TEMPLATES.items()
             for folder, name in loaded_files(ui_to_api(template(tpl)))}
    served = {"wan": {"path": str(checkpoints["wan"])},
              "flux": {"path": str(checkpoints["flux"]), "embedded_guidance": True}}
    (root / "omniloop-models.json").write_text(json.dumps({"served": served, "files": files}))
    from tests.flux_checkpoint import save_flux_loras

    (root / "loras").mkdir()
    detail = save_flux_loras(root / "_lora_src")["detail"]
    (root / "loras" / "flux_detail.safetensors").write_bytes(detail.read_bytes())
    return root


@pytest.fixture(scope="module")
def comfy_work(tmp_path_factory) -> Path:
    """The server's ComfyUI folders (input/, output/, temp/)."""
    return tmp_path_factory.mktemp("comfy_work")


@pytest.fixture(scope="module")
def comfy(wan_t2v_dir, flux_dir, tmp_path_factory, comfy_work):
    folder = models_folder(tmp_path_factory.mktemp("comfy_models"), {"wan": wan_t2v_dir, "flux": flux_dir})
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 64 * 64, "max_images": 4}
    with live_server({"wan": wan_t2v_dir, "flux": flux_dir}, limits=limits,
                     serve={"comfy_models": folder, "comfy_workdir": comfy_work}) as server:
        yield server


def workflow(name: str, **inputs: Any) -> dict[str, Any]:
    api = small(ui_to_api(template(name)))
    for node in api.values():
        node["inputs"].update({k: v for k, v in inputs.items() if k in node["inputs"]})
    return api


# -- the hand-written client: ComfyUI's websockets_api_example protocol ------------------------
class ScriptClient:
    def __init__(self, url: str) -> None:
        self.server = url.removeprefix("http://")
        self.client_id = str(uuid.uuid4())

    def queue_prompt(self, prompt: dict) -> dict:
        data = json.dumps({"prompt": prompt, "client_id": self.client_id}).encode()
        req = urllib.request.Request(f"http://{self.server}/prompt", data=data)
        return json.loads(urllib.request.urlopen(req).read())

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{self.server}{path}") as response:
            return response.read()

    def run(self, prompt: dict) -> tuple[str, list[dict], dict]:
        """Queue, read the socket until ``executing`` with node None, then the history."""
        ws = websocket.WebSocket()
        ws.connect(f"ws://{self.server}/ws?clientId={self.client_id}")
        ws.settimeout(120)  # a prompt that never ends fails the test instead of hanging it
        try:
            prompt_id = self.queue_prompt(prompt)["prompt_id"]
            messages = []
            while True:
                out = ws.recv()
                if isinstance(out, str):
                    message = json.loads(out)
                    messages.append(message)
                    data = message["data"]
                    if message["type"] == "executing" and data["node"] is None and data["prompt_id"] == prompt_id:
                        break
        finally:
            ws.close()
        history = json.loads(self.get(f"/history/{prompt_id}"))[prompt_id]
        return prompt_id, messages, history

    def view(self, item: dict) -> bytes:
        query = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item["subfolder"],
                                        "type": item["type"]})
        return self.get(f"/view?{query}")


def test_a_video_template_over_the_websocket_protocol(comfy):
    from omniloop.io.video import read_video

    client = ScriptClient(comfy.url)
    prompt = workflow("text_to_video_wan")
    prompt_id, messages, history = client.run(prompt)
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "status" and {"execution_start", "execution_cached", "executing", "progress", "executed",
                                     "execution_success"} <= set(kinds), kinds
    assert kinds.index("execution_start") < kinds.index("progress") < kinds.index("executed") \
        < kinds.index("execution_success")
    sampler = next(nid for nid, n in prompt.items() if n["class_type"] == "KSampler")
    progress = [m["data"] for m in messages if m["type"] == "progress"]
    assert [(p["value"], p["max"], p["node"]) for p in progress] == [(1, 2, sampler), (2, 2, sampler)]
    assert history["status"] == {"status_str": "success", "completed": True, "messages": history["status"]["messages"]}
    (save_id, output), = history["outputs"].items()
    assert prompt[save_id]["class_type"] == "SaveVideo" and output["animated"] == [True]
    (item,) = output["images"]
    assert item["subfolder"] == "video" and item["filename"].endswith(".mp4") and item["type"] == "output"
    frames, fps = read_video(client.view(item))
    assert frames.shape[:3] == (5, 32, 32) and fps == 16


def test_prompts_of_two_clients_run_at_once(comfy):
    """A Flux image and a Wan video queued together by two clients: each client hears only its
    own prompt and both complete on the one engine."""
    results: dict[str, Any] = {}

    def run(name: str, prompt: dict) -> None:
        results[name] = ScriptClient(comfy.url).run(prompt)

    threads = [threading.Thread(target=run, args=("flux", workflow("flux_schnell", seed=5))),
               threading.Thread(target=run, args=("wan", workflow("text_to_video_wan", seed=6)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for name, (prompt_id, messages, history) in results.items():
        assert history["status"]["completed"], name
        assert {m["data"].get("prompt_id") for m in messages if m["type"] != "status"} == {prompt_id}
    (image,) = next(iter(results["flux"][2]["outputs"].values()))["images"]
    from PIL import Image

    assert Image.open(io.BytesIO(ScriptClient(comfy.url).view(image))).size == (32, 32)


def test_a_bad_workflow_is_400_with_node_errors_and_nothing_is_queued(comfy):
    before = httpx.get(f"{comfy.url}/history").json()
    prompt = workflow("text_to_video_wan")
    sampler = next(nid for nid, n in prompt.items() if n["class_type"] == "KSampler")
    prompt[sampler]["inputs"]["cfg"] = -1.0
    prompt["99"] = {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "x.pth"}}
    r = httpx.post(f"{comfy.url}/prompt", json={"prompt": prompt})
    assert r.status_code == 400
    body = r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"][sampler]["errors"][0]["type"] == "value_smaller_than_min"
    assert body["node_errors"]["99"]["class_type"] == "UpscaleModelLoader"
    for bad in ("not json", json.dumps({"prompt": "x"}), json.dumps({"prompt": {"1": {"class_type": "KSampler"}}})):
        r = httpx.post(f"{comfy.url}/prompt", content=bad)
        assert r.status_code == 400 and "node_errors" in r.json(), r.text
    escape = workflow("text_to_video_wan")
    loader = next(nid for nid, n in escape.items() if n["class_type"] == "UNETLoader")
    escape[loader]["inputs"]["unet_name"] = "../../etc/passwd"
    r = httpx.post(f"{comfy.url}/prompt", json={"prompt": escape})
    assert "leaves the model folder" in r.json()["node_errors"][loader]["errors"][0]["message"]
    too_big = workflow("text_to_video_wan", width=512, height=512)  # over the deployment's max_pixels
    r = httpx.post(f"{comfy.url}/prompt", json={"prompt": too_big})
    assert r.status_code == 400 and r.json()["node_errors"][sampler]["errors"][0]["type"] == "invalid_input"
    taken = next(iter(before), None)
    if taken is not None:  # a client's own prompt_id must be new
        r = httpx.post(f"{comfy.url}/prompt", json={"prompt": workflow("text_to_video_wan"), "prompt_id": taken})
        assert r.status_code == 400 and "is taken" in r.json()["error"]["message"]
    assert httpx.get(f"{comfy.url}/queue").json() == {"queue_running": [], "queue_pending": []}
    assert httpx.get(f"{comfy.url}/history").json() == before
    assert httpx.get(f"{comfy.url}/health").status_code == 200


def test_interrupt_stops_the_running_prompt(comfy):
    client = ScriptClient(comfy.url)
    ws = websocket.WebSocket()
    ws.connect(f"ws://{client.server}/ws?clientId={client.client_id}")
    try:
        long = workflow("text_to_video_wan", steps=1000, width=64, height=64, length=17)
        prompt_id = client.queue_prompt(long)["prompt_id"]
        interrupted = False
        while True:
            message = json.loads(ws.recv())
            if message["type"] == "progress" and not interrupted:
                interrupted = True
                assert httpx.get(f"{comfy.url}/queue").json()["queue_running"][0][1] == prompt_id
                httpx.post(f"{comfy.url}/interrupt", json={})
            if message["type"] in ("execution_interrupted", "execution_success", "execution_error"):
                break
    finally:
        ws.close()
    assert message["type"] == "execution_interrupted" and message["data"]["node_type"] == "KSampler"
    assert httpx.get(f"{comfy.url}/history/{prompt_id}").json()[prompt_id]["status"]["status_str"] == "error"


def test_files_models_object_info_and_stats(comfy, tmp_path):
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(png, format="PNG")
    r = httpx.post(f"{comfy.url}/upload/image", files={"image": ("start.png", png.getvalue(), "image/png")})
    assert r.status_code == 200 and r.json() == {"name": "start.png", "subfolder": "", "type": "input"}, r.text
    r = httpx.post(f"{comfy.url}/upload/image", files={"image": ("x.png", b"not an image", "image/png")})
    assert r.status_code == 400
    view = httpx.get(f"{comfy.url}/view", params={"filename": "start.png", "type": "input"})
    assert view.status_code == 200 and view.content == png.getvalue()
    assert httpx.get(f"{comfy.url}/view", params={"filename": "../../omniloop-models.json"}).status_code == 404
    assert httpx.get(f"{comfy.url}/history/nope").json() == {}
    info = httpx.get(f"{comfy.url}/object_info").json()
    assert "uni_pc" in info["KSampler"]["input"]["required"]["sampler_name"][0]
    unet = httpx.get(f"{comfy.url}/object_info/UNETLoader").json()["UNETLoader"]
    assert unet["input"]["required"]["unet_name"][0] == ["wan2.1_t2v_1.3B_fp16.safetensors"]
    assert "start.png" in info["LoadImage"]["input"]["required"]["image"][0]
    assert httpx.get(f"{comfy.url}/models/vae").json() == ["wan_2.1_vae.safetensors"]
    stats = httpx.get(f"{comfy.url}/system_stats").json()
    assert stats["devices"][0]["type"] == "cpu" and stats["system"]["comfyui_version"].startswith("omniloop")
    assert httpx.get(f"{comfy.url}/v1/models").status_code == 200  # the OpenAI API beside it


def test_the_comfy_api_simplified_client(comfy, tmp_path):
    """comfy-api-simplified (PyPI) queues a workflow saved in API format, waits on the socket,
    and fetches the image its SaveImage node (found by title) wrote."""
    simplified = pytest.importorskip("comfy_api_simplified")
    path = tmp_path / "flux_schnell_api.json"
    path.write_text(json.dumps(workflow("flux_schnell", seed=11)))
    api = simplified.ComfyApiWrapper(comfy.url)
    flow = simplified.ComfyWorkflowWrapper(str(path))
    flow.set_node_param("CLIP Text Encode (Positive Prompt)", "text", "a red circle on a blue sky")
    images = api.queue_and_wait_images(flow, "SaveImage")
    (data,) = images.values()
    from PIL import Image

    assert Image.open(io.BytesIO(data)).size == (32, 32)
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}


def test_prompts_queued_together_batch_their_steps(comfy):
    """Three Wan prompts (different seeds, one shape) posted back to back: the engine runs
    their denoise steps together, where ComfyUI's queue would run them one after another."""
    import time

    before = comfy.engine.stats()["batched_steps"]
    ids = [httpx.post(f"{comfy.url}/prompt", json={"prompt": workflow("text_to_video_wan", seed=s, steps=40),
                                                   "client_id": f"c{s}"}).json()["prompt_id"] for s in (1, 2, 3)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        history = httpx.get(f"{comfy.url}/history").json()
        if all(i in history for i in ids):
            break
        time.sleep(0.05)
    assert all(history[i]["status"]["completed"] for i in ids)
    assert comfy.engine.stats()["batched_steps"] > before


def test_a_lora_of_the_folder_applies_to_its_prompt(comfy):
    """LoraLoaderModelOnly naming a file of loras/: registered with the served model on first
    use, applied to this prompt only (the same seed without it makes another image)."""
    def image_of(prompt: dict) -> bytes:
        _, _, history = ScriptClient(comfy.url).run(prompt)
        (item,) = next(iter(history["outputs"].values()))["images"]
        return ScriptClient(comfy.url).view(item)

    plain = workflow("flux_schnell", seed=21)
    with_lora = workflow("flux_schnell", seed=21)
    loader = next(nid for nid, n in with_lora.items() if n["class_type"] == "CheckpointLoaderSimple")
    sampler = next(nid for nid, n in with_lora.items() if n["class_type"] == "KSampler")
    with_lora["50"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": [loader, 0], "lora_name": "flux_detail.safetensors", "strength_model": 1.0}}
    with_lora[sampler]["inputs"]["model"] = ["50", 0]
    assert image_of(with_lora) != image_of(plain)
    assert image_of(plain) == image_of(plain)  # the adapter stays with the prompt that named it
    with_lora["50"]["inputs"]["lora_name"] = "missing.safetensors"
    r = httpx.post(f"{comfy.url}/prompt", json={"prompt": with_lora})
    assert r.status_code == 400
    assert "flux_detail.safetensors" in r.json()["node_errors"]["50"]["errors"][0]["details"]  # what exists


def wait_history(url: str, ids: list[str], timeout: float = 120) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = httpx.get(f"{url}/history").json()
        if all(i in history for i in ids):
            return history
        time.sleep(0.05)
    raise AssertionError(f"prompts {[i for i in ids if i not in history]} did not finish in {timeout} s")


def test_a_burst_of_saves_with_one_prefix_gets_distinct_files(comfy, comfy_work):
    """Eight Flux prompts posted at once, all saving with the prefix ``burst/race``: their
    saves run concurrently, and each gets its own file, numbered as ComfyUI numbers them: the
    highest counter already there + 1 (8: the old count + 1 would have reused 3)."""
    from PIL import Image

    folder = comfy_work / "output" / "burst"
    folder.mkdir(parents=True)
    for name in ("race_00002_.png", "race_00007_.png", "racer_00050_.png", "race_notes.txt"):
        (folder / name).write_bytes(b"earlier")
    prompts = [workflow("flux_schnell", seed=100 + i, filename_prefix="burst/race") for i in range(8)]
    with httpx.Client() as client:
        ids = [client.post(f"{comfy.url}/prompt", json={"prompt": p}).json()["prompt_id"] for p in prompts]
    history = wait_history(comfy.url, ids)
    items = []
    for i in ids:
        assert history[i]["status"]["completed"], history[i]["status"]
        (output,) = history[i]["outputs"].values()
        items += output["images"]
    names = sorted(item["filename"] for item in items)
    assert names == [f"race_{n:05d}_.png" for n in range(8, 16)], names
    for item in items:
        assert item["subfolder"] == "burst" and item["type"] == "output"
        assert Image.open(io.BytesIO(ScriptClient(comfy.url).view(item))).size == (32, 32)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        names + ["race_00002_.png", "race_00007_.png", "racer_00050_.png", "race_notes.txt"])  # no partials left


def test_a_save_that_fails_is_an_execution_error_and_the_next_prompt_runs(comfy, comfy_work):
    """SaveImage into ``blocked/``, where output/blocked is a regular file: the directory
    cannot be made, the prompt ends with ComfyUI's execution_error naming the save node (and
    the ``executing`` end message), /history says error, and the server runs the next prompt."""
    (comfy_work / "output" / "blocked").write_text("a file where the subfolder would be")
    client = ScriptClient(comfy.url)
    prompt = workflow("flux_schnell", seed=7, filename_prefix="blocked/img")
    save = next(nid for nid, n in prompt.items() if n["class_type"] == "SaveImage")
    prompt_id, messages, history = client.run(prompt)
    mine = [m for m in messages if m["data"].get("prompt_id") == prompt_id]
    kinds = [m["type"] for m in mine]
    assert "execution_success" not in kinds and kinds[-1] == "executing", kinds
    (error,) = [m["data"] for m in mine if m["type"] == "execution_error"]
    assert (error["node_id"], error["node_type"], error["exception_type"]) == (save, "SaveImage", "FileExistsError")
    assert "blocked" in error["exception_message"] and error["traceback"], error
    assert history["status"]["status_str"] == "error" and not history["status"]["completed"]
    assert [m[0] for m in history["status"]["messages"]][-1] == "execution_error"
    assert history["outputs"] == {}
    _, _, after = client.run(workflow("flux_schnell", seed=7, filename_prefix="unblocked/img"))
    assert after["status"]["completed"]
    (item,) = after["outputs"][save]["images"]
    assert item == {"filename": "img_00001_.png", "subfolder": "unblocked", "type": "output"}
    assert httpx.get(f"{comfy.url}/queue").json() == {"queue_running": [], "queue_pending": []}
