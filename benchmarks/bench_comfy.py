"""A burst of ComfyUI workflow prompts through omniloop's ComfyUI API, all submitted at once
(the engine batches their denoise steps) vs the same prompts one at a time (ComfyUI's queue
semantics: the next is submitted when the previous finished), through the same server.

    python benchmarks/bench_comfy.py --tiny                       # CPU smoke: the tests' toy sizes
    python benchmarks/bench_comfy.py --device cuda --out $OUT/comfy_h100.jsonl   # GPU, ~5 min on an H100

The workflows are the official ComfyUI templates the workflows/ compiler runs
(package ``comfyui-workflow-templates-json``, or ``--templates DIR`` holding their JSON files):
``flux_dev_full_text_to_image`` (FLUX.1-dev; seeds 1..N, sizes 512, 768 and 1024 square in
turn) and ``text_to_video_wan`` (Wan2.1-T2V-1.3B, its own 480x832x33, cfg 6; seeds 1..N), with
their steps set to ``--steps`` (GPU default: Flux 8, Wan 4). Weights are random at the published
architectures: the FLUX.1-dev transformer (12B) and VAE built in memory (benchmarks/flux_random.py),
the Wan2.1-1.3B transformer and VAE saved as a diffusers folder in a temporary directory and
loaded by the server (benchmarks/wan_random.py); the text encoders have the real output widths
and one layer. A temporary ComfyUI models folder maps the template's file names to the served
model (``omniloop-models.json``, docs/comfyui.md).

Each family gets its own server on 127.0.0.1 (uvicorn in a thread, as tests/serve starts it),
driven by a client written after ComfyUI's ``script_examples/websockets_api_example.py``: POST
/prompt with a client_id, read /ws until ``executing`` with ``node: null`` for the prompt, then
/history and /view. Before timing, every shape runs once alone and once in a small burst
(kernels, compiled blocks). Latency: from a prompt's POST to its end message; throughput: prompts
over the time from the first POST to the last end. One JSON line per mode and a ratios line per
family (appended to --out); every temporary checkpoint and folder is deleted at the end.

Without PyAV (``av``) the Wan workflow's CreateVideo -> SaveVideo (mp4) is replaced by SaveImage
of the same frames (PNG files), and the records say so (``saved_as``).

``--baseline comfyui --comfyui-root .comfyui/src`` (Flux only) measures ComfyUI itself beside
omniloop on the same prompts and the same bytes: benchmarks/comfy_weights.py writes a ComfyUI
models folder of random weights in the original layouts (GPU: FLUX.1-dev, ae, CLIP-L, T5-XXL in
bf16, ~34 GB; ``--tiny``: ComfyUI's CPU-runnable size, a 3072-wide DiT of one double and one
single block beside the full-size VAE and text encoders, ~11 GB), with ComfyUI's own tokenizer
folders copied beside them. omniloop serves it from single files (``--comfy-models DIR``: the
pipeline is built from the workflow's loader files); then ComfyUI's ``main.py`` runs as a
subprocess on a free 127.0.0.1 port (``--extra-model-paths-config`` naming the folder, custom
and API nodes off, output / input / temp / user folders in a temporary folder, ``--cpu`` on the
CPU, its dtype flags set to ``--dtype``), and the same client drives it in the same two modes
(its queue runs the burst FIFO). Every line carries ``"server"``; a ``servers`` line compares
the two, an ``agreement`` line compares the images both made of each prompt (same seed): PSNR
and max abs difference of the saved PNGs. ComfyUI is GPL-3.0: none of its code is here, it runs
as its own process (benchmarks/comfyui_baseline_setup.sh fetches and prepares it, docs/comfyui.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import agreement, emit, fill_unset  # noqa: E402

FLUX_TEMPLATE, WAN_TEMPLATE = "flux_dev_full_text_to_image", "text_to_video_wan"
FAMILIES = ("flux", "wan")
WEIGHTS = {"dev": "random, FLUX.1-dev architecture", "full": "random, Wan2.1-T2V-1.3B architecture",
           "tiny": "random, the tests' toy"}


@dataclass(frozen=True)
class Scale:
    """Sizes and steps of one run (``--tiny``: the tests' toy checkpoints on a CPU)."""

    flux_size: str  # benchmarks/flux_random.py SIZES
    wan_size: str  # benchmarks/wan_random.py SIZES
    flux_sides: tuple[int, ...]  # square image sides, in turn over the prompts
    wan_shape: tuple[int, int, int]  # height, width, frames
    flux_steps: int
    wan_steps: int


GPU = Scale("dev", "full", (512, 768, 1024), (480, 832, 33), flux_steps=8, wan_steps=4)
TINY = Scale("tiny", "tiny", (32, 48, 64), (32, 32, 5), flux_steps=4, wan_steps=4)


# -- the workflows ---------------------------------------------------------------------------
def templates_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        import comfyui_workflow_templates_json
    except ImportError:
        raise SystemExit(f"the ComfyUI templates: pip install comfyui-workflow-templates-json, or pass --templates DIR "
                         f"holding {FLUX_TEMPLATE}.json and {WAN_TEMPLATE}.json") from None

    return Path(comfyui_workflow_templates_json.__file__).parent / "templates"


def template_api(folder: Path, name: str) -> dict[str, Any]:
    """The template (UI format, as the package ships it) in API format."""
    from omniloop.workflows.ui_format import ui_to_api

    return ui_to_api(json.loads((folder / f"{name}.json").read_text()))


def node_of(api: dict[str, Any], class_type: str) -> dict[str, Any]:
    (node,) = [n for n in api.values() if n["class_type"] == class_type]
    return node


def flux_prompts(base: dict[str, Any], n: int, sides: tuple[int, ...], steps: int) -> list[dict[str, Any]]:
    prompts = []
    for i in range(n):
        api = copy.deepcopy(base)
        node_of(api, "KSampler")["inputs"].update(seed=i + 1, steps=steps)
        node_of(api, "EmptySD3LatentImage")["inputs"].update(width=sides[i % len(sides)], height=sides[i % len(sides)])
        prompts.append(api)
    return prompts


def wan_prompts(base: dict[str, Any], n: int, shape: tuple[int, int, int], steps: int) -> list[dict[str, Any]]:
    height, width, frames = shape
    prompts = []
    for i in range(n):
        api = copy.deepcopy(base)
        node_of(api, "KSampler")["inputs"].update(seed=i + 1, steps=steps)
        node_of(api, "EmptyHunyuanLatentVideo")["inputs"].update(width=width, height=height, length=frames)
        prompts.append(api)
    return prompts


def frames_as_png(api: dict[str, Any]) -> dict[str, Any]:
    """SaveVideo (mp4, needs PyAV) -> SaveImage of the frames CreateVideo was given."""
    for node in api.values():
        if node["class_type"] == "SaveVideo":
            create = api[node["inputs"]["video"][0]]
            node.update(class_type="SaveImage", inputs={"images": create["inputs"]["images"],
                                                         "filename_prefix": "video/frames"})
    return api


def models_folder(root: Path, api: dict[str, Any], family: str, checkpoint: str, embedded_guidance: bool) -> Path:
    """A ComfyUI models folder whose ``omniloop-models.json`` maps every file the workflow's
    loaders name to the one served model."""
    from omniloop.serve.comfy import MODEL_INPUTS

    files = {f"{MODEL_INPUTS[key]}/{value}": family for node in api.values()
             for key, value in node["inputs"].items() if key in MODEL_INPUTS and isinstance(value, str)}
    served = {family: {"path": checkpoint, "embedded_guidance": embedded_guidance}}
    (root / "omniloop-models.json").write_text(json.dumps({"served": served, "files": files}))
    return root


# -- the server ------------------------------------------------------------------------------
@contextlib.contextmanager
def comfy_server(engine, folder: Path, workdir: Path) -> Iterator[str]:
    """``omniloop serve --comfy-models folder`` over ``engine``, in a thread; yields its URL."""
    import httpx
    import uvicorn

    from omniloop.serve.app import create_app
    from omniloop.serve.config import ServeConfig
    from omniloop.serve.server import DrainingServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no free-port race
    config = ServeConfig(port=sock.getsockname()[1], warmup=[], comfy_models=folder, comfy_workdir=workdir)
    app = create_app(engine, config)
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), app.state.omniloop)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after 120 s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


class ComfyClient:
    """ComfyUI's websockets_api_example protocol: one client id, POST /prompt, the socket's
    messages (read by a thread, each stamped when it arrives), /history and /view."""

    def __init__(self, url: str) -> None:
        import websocket

        self.server = url.removeprefix("http://")
        self.client_id = str(uuid.uuid4())
        self.ws = websocket.WebSocket()
        self.ws.connect(f"ws://{self.server}/ws?clientId={self.client_id}")
        self.ended: queue.Queue[tuple[str, float]] = queue.Queue()  # (prompt_id, when its end message came)
        self.timelines: dict[str, list[tuple[str, str | None, float]]] = {}  # prompt_id -> (type, node, when)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # the socket closed
            while True:
                out = self.ws.recv()
                now = time.perf_counter()
                if isinstance(out, str):
                    message = json.loads(out)
                    data = message.get("data", {})
                    if "prompt_id" in data:
                        self.timelines.setdefault(data["prompt_id"], []).append((message["type"], data.get("node"), now))
                    if message["type"] == "executing" and data.get("node") is None and "prompt_id" in data:
                        self.ended.put((data["prompt_id"], now))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()

    def phases(self, prompt_id: str, posted: float) -> tuple[float, float]:
        """(seconds from the POST to the prompt's first ``progress``, seconds its output nodes
        took: each from ``executing`` that node to its ``executed``)."""
        timeline = self.timelines[prompt_id]
        started = next(t for kind, _, t in timeline if kind == "progress")
        entered = {node: t for kind, node, t in timeline if kind == "executing"}
        saving = sum(t - entered[node] for kind, node, t in timeline if kind == "executed")
        return started - posted, saving

    def queue_prompt(self, prompt: dict[str, Any]) -> str:
        data = json.dumps({"prompt": prompt, "client_id": self.client_id}).encode()
        request = urllib.request.Request(f"http://{self.server}/prompt", data=data)
        try:
            return json.loads(urllib.request.urlopen(request).read())["prompt_id"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"POST /prompt: {e.code} {e.read().decode()[:2000]}") from None

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{self.server}{path}") as response:
            return response.read()

    def wait(self, ids: set[str], timeout: float) -> dict[str, float]:
        """When each of ``ids`` ended (perf_counter)."""
        done: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while not ids <= done.keys():
            try:
                prompt_id, when = self.ended.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{len(ids - done.keys())} prompt(s) not finished after {timeout:.0f} s") from None
            if prompt_id in ids:
                done[prompt_id] = when
        return done

    def outputs(self, prompt_id: str) -> list[dict[str, Any]]:
        """The files a finished prompt saved; raises unless it succeeded."""
        item = json.loads(self.get(f"/history/{prompt_id}"))[prompt_id]
        if not item["status"]["completed"]:
            raise RuntimeError(f"prompt {prompt_id} failed: {item['status']['messages'][-1:]}")
        return [f for output in item["outputs"].values() for f in output.get("images", [])]

    def view(self, item: dict[str, Any]) -> bytes:
        query = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item["subfolder"],
                                        "type": item["type"]})
        return self.get(f"/view?{query}")


# -- ComfyUI itself (--baseline comfyui) -----------------------------------------------------
COMFYUI_DTYPE_FLAGS = {"bfloat16": ("--bf16-unet", "--bf16-vae", "--bf16-text-enc"),
                       "float16": ("--fp16-unet", "--fp16-vae", "--fp16-text-enc"),
                       "float32": ("--fp32-unet", "--fp32-vae", "--fp32-text-enc")}


def comfyui_command(root: Path, port: int, models: Path, work: Path, device: str, dtype: str) -> list[str]:
    """ComfyUI's ``main.py`` headless on 127.0.0.1:port, reading the models of ``models`` (an
    extra model paths file) and writing only under ``work``; its dtypes set to ``dtype`` (the
    DiT, VAE and text encoders: the same as omniloop's); no custom nodes, no API nodes, an
    in-memory database; an empty front end folder (the API does not need one)."""
    paths = work / "extra_model_paths.yaml"
    paths.write_text(f"omniloop_bench:\n    base_path: {models}\n    diffusion_models: diffusion_models\n"
                     "    vae: vae\n    text_encoders: text_encoders\n")
    dirs = {name: work / name for name in ("base", "output", "input", "temp", "user", "frontend")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(root / "main.py"), "--listen", "127.0.0.1", "--port", str(port),
               "--base-directory", str(dirs["base"]), "--extra-model-paths-config", str(paths),
               "--output-directory", str(dirs["output"]), "--input-directory", str(dirs["input"]),
               "--temp-directory", str(dirs["temp"]), "--user-directory", str(dirs["user"]),
               "--disable-all-custom-nodes", "--disable-api-nodes", "--disable-auto-launch",
               "--database-url", "sqlite:///:memory:", *COMFYUI_DTYPE_FLAGS[dtype]]
    # the API needs no front end: an empty one whether or not its package is installed
    (dirs["frontend"] / "index.html").write_text("<!doctype html><title>ComfyUI API only</title>")
    command += ["--front-end-root", str(dirs["frontend"])]
    return command + (["--cpu"] if device == "cpu" else [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def comfyui_server(root: Path, models: Path, work: Path, device: str, dtype: str, site: list[str],
                   timeout: float = 300) -> Iterator[str]:
    """ComfyUI as its own process (GPL-3.0: run, never imported); yields its URL once
    ``/system_stats`` answers; stopped (terminate, then kill) at the end. Its log: work/comfyui.log."""
    if not (root / "main.py").is_file():
        raise SystemExit(f"--comfyui-root {root}: no main.py there; run benchmarks/comfyui_baseline_setup.sh first")
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([*site, *filter(None, [os.environ.get("PYTHONPATH")])]))
    log = open(work / "comfyui.log", "wb")
    process = subprocess.Popen(comfyui_command(root, port, models, work, device, dtype), cwd=root, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {process.returncode}: "
                                   f"{(work / 'comfyui.log').read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/system_stats", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ComfyUI not answering on {url} after {timeout:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def saved_images(client: ComfyClient, runs: list[tuple[str, float, float]]) -> list[bytes]:
    """Each prompt's first saved file (PNG bytes), in prompt order."""
    return [client.view(client.outputs(pid)[0]) for pid, _, _ in runs]


def server_agreement(ours: list[bytes], theirs: list[bytes]) -> dict[str, Any]:
    """The two servers' images of the same prompts (same seeds): ``common.agreement`` (PSNR against
    8-bit peak 255, the largest absolute pixel difference) per prompt and summed up."""
    import io

    import numpy as np
    from PIL import Image

    psnrs, maxes = [], []
    for a, b in zip(ours, theirs):
        x, y = (torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))) for data in (a, b))
        if x.shape != y.shape:
            raise RuntimeError(f"the servers saved images of other sizes: {tuple(x.shape)} vs {tuple(y.shape)}")
        same = agreement(x, y, data_range=255.0)
        psnrs.append(same["psnr_db"])
        maxes.append(int(same["max_abs_diff"]))
    finite = [p for p in psnrs if p != float("inf")]
    return {"psnr_db": psnrs, "max_abs_diff": maxes, "psnr_min_db": min(psnrs),
            "psnr_mean_db": round(sum(finite) / len(finite), 2) if finite else float("inf"),
            "max_abs_diff_max": max(maxes)}


# -- the two modes ---------------------------------------------------------------------------
def burst(client: ComfyClient, prompts: list[dict[str, Any]], timeout: float) -> list[tuple[str, float, float]]:
    """Every prompt POSTed at once, as many clients do (each POST compiles its workflow before it
    answers: back to back, a toy prompt could finish before the next one was queued): (id, posted,
    ended) each."""
    from concurrent.futures import ThreadPoolExecutor

    def post(prompt: dict[str, Any]) -> tuple[str, float]:
        t0 = time.perf_counter()
        return client.queue_prompt(prompt), t0

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        posted = list(pool.map(post, prompts))
    ended = client.wait({pid for pid, _ in posted}, timeout)
    return [(pid, t0, ended[pid]) for pid, t0 in posted]


def one_at_a_time(client: ComfyClient, prompts: list[dict[str, Any]], timeout: float) -> list[tuple[str, float, float]]:
    """ComfyUI's queue semantics: the next prompt once the previous one finished."""
    runs = []
    for prompt in prompts:
        t0 = time.perf_counter()
        pid = client.queue_prompt(prompt)
        runs.append((pid, t0, client.wait({pid}, timeout)[pid]))
    return runs


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def checked_files(client: ComfyClient, runs: list[tuple[str, float, float]], media: str) -> int:
    """Every prompt succeeded; the first one's first file is served by /view and decodes."""
    files = [client.outputs(pid) for pid, _, _ in runs]
    assert all(files), "a prompt saved no file"
    data = client.view(files[0][0])
    if files[0][0]["filename"].endswith(".png"):
        import io

        from PIL import Image

        Image.open(io.BytesIO(data)).verify()
    else:
        assert data[4:8] == b"ftyp", f"{media}: /view did not return an mp4"
    return sum(len(f) for f in files)


def measure(client: ComfyClient, engine, mode: str, prompts: list[dict[str, Any]], steps: int,
            timeout: float) -> dict[str, Any]:
    """One mode's record; ``engine`` None: the server is ComfyUI (no engine counters)."""
    before = engine.stats() if engine is not None else None
    runs = (burst if mode == "burst" else one_at_a_time)(client, prompts, timeout)
    latencies = [end - t0 for _, t0, end in runs]
    waits, saves = zip(*(client.phases(pid, t0) for pid, t0, _ in runs))
    wall = max(end for _, _, end in runs) - min(t0 for _, t0, _ in runs)
    record = {"mode": mode, "prompts": len(prompts), "wall_s": round(wall, 3), "per_s": round(len(prompts) / wall, 4),
              "latency_p50_s": round(percentile(latencies, 0.5), 3),
              "latency_p95_s": round(percentile(latencies, 0.95), 3),
              "latency_mean_s": round(sum(latencies) / len(latencies), 3),
              # POST -> first step (queued behind others), and the output nodes' file writing, per prompt
              "wait_to_first_step_mean_s": round(sum(waits) / len(waits), 3),
              "save_mean_s": round(sum(saves) / len(saves), 3)}
    if engine is not None:
        after = engine.stats()
        engine_steps = after["steps"] - before["steps"]
        record |= {"engine_steps": engine_steps, "batched_steps": after["batched_steps"] - before["batched_steps"],
                   "mean_batch": round(len(prompts) * steps / engine_steps, 2)}  # denoise steps per engine step
    return record | {"files": checked_files(client, runs, mode), "runs": runs}


def warm(client: ComfyClient, prompts: list[dict[str, Any]], shapes: int, timeout: float) -> float:
    """Each shape alone, then the shapes at once (twice when there is one shape, so the batched
    step runs): cuDNN plans, compiled blocks for both batch sizes. Seconds taken."""
    t0 = time.perf_counter()
    first = prompts[:shapes]
    one_at_a_time(client, first, timeout)
    burst(client, first if shapes > 1 else prompts[:2], timeout)
    return time.perf_counter() - t0


# -- the families ----------------------------------------------------------------------------
def flux_engine(scale: Scale, deploy) -> tuple[Any, str]:
    from flux_random import random_flux_pipeline

    from omniloop.engine import AsyncEngine, Engine, EngineConfig
    from omniloop.engine.async_engine import load_options

    _, pipeline = random_flux_pipeline(scale.flux_size, load_options(deploy))
    return AsyncEngine(Engine(pipeline, EngineConfig.from_deploy(deploy)), model_name="flux"), "random (in memory)"


def wan_engine(scale: Scale, deploy, scratch: Path) -> tuple[Any, str]:
    from wan_random import save_random_wan

    from omniloop.engine import AsyncEngine

    folder = save_random_wan(scratch / "wan", size=scale.wan_size, device=deploy.torch_device().type)
    return AsyncEngine.from_pretrained(folder, deploy=deploy), str(folder)


def bench_family(family: str, args, scale: Scale, deploy, templates: Path, scratch: Path, sink) -> None:
    timeout = args.timeout
    t0 = time.perf_counter()
    if family == "flux":
        steps = args.steps or scale.flux_steps
        base = template_api(templates, FLUX_TEMPLATE)
        prompts, shapes = flux_prompts(base, args.prompts, scale.flux_sides, steps), len(scale.flux_sides)
        engine, checkpoint = flux_engine(scale, deploy)
        saved_as, media = "png", "images"
    else:
        steps = args.steps or scale.wan_steps
        base = template_api(templates, WAN_TEMPLATE)
        has_av = importlib.util.find_spec("av") is not None
        if not has_av:
            base = frames_as_png(base)
        prompts, shapes = wan_prompts(base, args.prompts, scale.wan_shape, steps), 1
        engine, checkpoint = wan_engine(scale, deploy, scratch)
        saved_as, media = ("mp4" if has_av else "png_frames"), "videos"
    built_s = time.perf_counter() - t0
    folder = models_folder(Path(tempfile.mkdtemp(dir=scratch, prefix="models_")), base, family, checkpoint,
                           embedded_guidance=family == "flux")
    head = {"bench": "comfy_burst", "server": "omniloop", "family": family, "template": FLUX_TEMPLATE if family == "flux" else WAN_TEMPLATE,
            "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "dtype": args.dtype, "weights": WEIGHTS[scale.flux_size if family == "flux" else scale.wan_size],
            "steps": steps, "max_batch": args.max_batch, "compile": deploy.compile, "saved_as": saved_as,
            "shapes": ([f"{s}x{s}" for s in scale.flux_sides] if family == "flux"
                       else ["x".join(map(str, scale.wan_shape))])}
    try:
        with comfy_server(engine, folder, Path(tempfile.mkdtemp(dir=scratch, prefix="work_"))) as url:
            client = ComfyClient(url)
            try:
                warm_s = warm(client, prompts, shapes, timeout)
                emit({**head, "mode": "setup", "build_s": round(built_s, 2), "warmup_s": round(warm_s, 2)}, sink)
                results = {}
                for mode in ("one_at_a_time", "burst"):
                    record = measure(client, engine, mode, prompts, steps, timeout)
                    record.pop("runs")
                    record[f"{media}_per_s"] = record.pop("per_s")
                    results[mode] = record
                    emit({**head, **record}, sink)
            finally:
                client.close()
    finally:
        engine.shutdown()
    seq, bur = results["one_at_a_time"], results["burst"]
    emit({**head, "mode": "ratios",
          "throughput_burst_vs_one_at_a_time": round(bur[f"{media}_per_s"] / seq[f"{media}_per_s"], 3),
          "p50_burst_vs_one_at_a_time": round(bur["latency_p50_s"] / seq["latency_p50_s"], 3),
          "p95_burst_vs_one_at_a_time": round(bur["latency_p95_s"] / seq["latency_p95_s"], 3)}, sink)


# -- omniloop and ComfyUI on the same files (--baseline comfyui) ------------------------------
def shared_models(args, scale: Scale, scratch: Path) -> tuple[Path, dict[str, Any]]:
    """The ComfyUI models folder both servers read: ``--models-dir`` when it holds the four
    files already (written by an earlier run), else written there (or in the scratch folder)."""
    from comfy_weights import CLIP, DIT, T5, TOKENIZERS, VAE, write_flux_folder

    folder = Path(args.models_dir) if args.models_dir else scratch / "shared_models"
    if all((folder / rel).exists() for rel in (DIT, VAE, CLIP, T5, *TOKENIZERS)):
        return folder, {"size": "as found", "reused": True}
    size = "comfy-tiny" if scale is TINY else "full"
    t0 = time.perf_counter()
    record = write_flux_folder(folder, size, dtype=torch.bfloat16, comfyui_root=Path(args.comfyui_root),
                               device=args.device)
    return folder, {**record, "reused": False, "write_s": round(time.perf_counter() - t0, 1),
                    "gb": round(sum(record["bytes"].values()) / 1e9, 2)}


def server_modes(client: ComfyClient, engine, prompts: list[dict[str, Any]], shapes: int, steps: int, timeout: float,
                 head: dict[str, Any], built_s: float, sink) -> tuple[dict[str, dict[str, Any]], list[bytes]]:
    """Warm up, then one at a time and the burst through one server; -> the two records and
    the one-at-a-time images (PNG bytes, prompt order)."""
    warm_s = warm(client, prompts, shapes, timeout)
    emit({**head, "mode": "setup", "build_s": round(built_s, 2), "warmup_s": round(warm_s, 2)}, sink)
    results, images = {}, []
    for mode in ("one_at_a_time", "burst"):
        record = measure(client, engine, mode, prompts, steps, timeout)
        runs = record.pop("runs")
        if mode == "one_at_a_time":
            images = saved_images(client, runs)
        record["images_per_s"] = record.pop("per_s")
        results[mode] = record
        emit({**head, **record}, sink)
    seq, bur = results["one_at_a_time"], results["burst"]
    emit({**head, "mode": "ratios", "throughput_burst_vs_one_at_a_time": round(bur["images_per_s"] / seq["images_per_s"], 3),
          "p50_burst_vs_one_at_a_time": round(bur["latency_p50_s"] / seq["latency_p50_s"], 3),
          "p95_burst_vs_one_at_a_time": round(bur["latency_p95_s"] / seq["latency_p95_s"], 3)}, sink)
    return results, images


def comfyui_version(root: Path) -> str | None:
    import re

    path = root / "comfyui_version.py"
    found = re.search(r"__version__\s*=\s*[\"']([^\"']+)", path.read_text()) if path.is_file() else None
    return found[1] if found else None


def bench_flux_servers(args, scale: Scale, deploy, templates: Path, scratch: Path, sink) -> None:
    """The Flux template's prompts through omniloop, then through ComfyUI, from one models folder."""
    from omniloop.api.generator import DEFAULT_MODEL
    from omniloop.engine import AsyncEngine

    root = Path(args.comfyui_root).resolve()
    steps = args.steps or scale.flux_steps
    prompts = flux_prompts(template_api(templates, FLUX_TEMPLATE), args.prompts, scale.flux_sides, steps)
    shapes = len(scale.flux_sides)
    folder, weights = shared_models(args, scale, scratch)
    head = {"bench": "comfy_burst", "family": "flux", "template": FLUX_TEMPLATE, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "dtype": args.dtype,
            "weights": f"random, {weights['size']} (the same single files for both servers)", "steps": steps,
            "saved_as": "png", "shapes": [f"{s}x{s}" for s in scale.flux_sides]}
    emit({**head, "mode": "weights", **{k: v for k, v in weights.items() if k != "facts"}}, sink)

    # omniloop: ComfyUI's API over a pool that builds the workflow's single files on first use
    t0 = time.perf_counter()
    engine = AsyncEngine.serving_models({"default": DEFAULT_MODEL}, deploy=deploy)
    ours_head = {**head, "server": "omniloop", "max_batch": args.max_batch, "compile": deploy.compile}
    try:
        with comfy_server(engine, folder, Path(tempfile.mkdtemp(dir=scratch, prefix="work_"))) as url:
            client = ComfyClient(url)
            try:
                ours, our_images = server_modes(client, engine, prompts, shapes, steps, args.timeout, ours_head,
                                                time.perf_counter() - t0, sink)
            finally:
                client.close()
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    # ComfyUI itself, on the same folder (gpu_held_gb: what this process still holds on the GPU
    # while ComfyUI runs; ComfyUI sizes its model residency from the free memory it sees)
    theirs_head = {**head, "server": "comfyui", "comfyui_version": comfyui_version(root),
                   "gpu_held_gb": round(torch.cuda.memory_reserved() / 1e9, 2) if args.device == "cuda" else None}
    site = [p for p in args.comfyui_site.split(os.pathsep) if p]
    work = Path(tempfile.mkdtemp(dir=scratch, prefix="comfyui_"))
    t0 = time.perf_counter()
    try:
        with comfyui_server(root, folder.resolve(), work, args.device, args.dtype, site) as url:
            client = ComfyClient(url)
            try:
                theirs, their_images = server_modes(client, None, prompts, shapes, steps, args.timeout, theirs_head,
                                                    time.perf_counter() - t0, sink)
            finally:
                client.close()
    except Exception:
        log = work / "comfyui.log"
        if log.is_file():
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    emit({**head, "mode": "servers",
          **{f"throughput_omniloop_vs_comfyui_{m}": round(ours[m]["images_per_s"] / theirs[m]["images_per_s"], 3)
             for m in ("one_at_a_time", "burst")},
          **{f"p{q}_omniloop_vs_comfyui_{m}": round(ours[m][f"latency_p{q}_s"] / theirs[m][f"latency_p{q}_s"], 3)
             for m in ("one_at_a_time", "burst") for q in (50, 95)},
          # what a ComfyUI user gets (its queue) vs the same prompts at once on omniloop
          "throughput_omniloop_burst_vs_comfyui_burst": round(ours["burst"]["images_per_s"]
                                                              / theirs["burst"]["images_per_s"], 3)}, sink)
    emit({**head, "mode": "agreement", "compared": "one_at_a_time images, prompt by prompt (same seeds)",
          **server_agreement(our_images, their_images)}, sink)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' toy checkpoints and sizes (CPU smoke)")
    parser.add_argument("--only", default=",".join(FAMILIES), help="families, comma-separated: flux,wan")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per family and mode")
    parser.add_argument("--steps", type=int, default=None, help="denoise steps of every prompt "
                        f"(default: Flux {GPU.flux_steps}, Wan {GPU.wan_steps}; --tiny: {TINY.flux_steps})")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one; --tiny: cpu)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--max-batch", type=int, default=8, help="DeployConfig.max_batch: requests per batched step")
    parser.add_argument("--templates", default=None, help="folder holding the two template JSON files "
                        "(default: the comfyui-workflow-templates-json package's)")
    parser.add_argument("--no-compile", action="store_true", help="DeployConfig.compile=False (default \"auto\": "
                        "the family's fast path, on CUDA Wan's blocks are compiled)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a mode may take")
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    parser.add_argument("--baseline", choices=("none", "comfyui"), default="none",
                        help="comfyui: measure ComfyUI itself beside omniloop on the same files (Flux only)")
    parser.add_argument("--comfyui-root", default=".comfyui/src", help="ComfyUI's source (its main.py), "
                        "prepared by benchmarks/comfyui_baseline_setup.sh")
    parser.add_argument("--comfyui-site", default="", help=f"folders put first on ComfyUI's PYTHONPATH "
                        f"('{os.pathsep}'-separated; e.g. where its missing requirements were installed)")
    parser.add_argument("--models-dir", default=None, help="the shared models folder (--baseline comfyui): "
                        "reused when it holds the four files, else written there (default: a temporary one)")
    args = parser.parse_args()
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    if not only or set(only) - set(FAMILIES):
        parser.error(f"--only {args.only!r}: pass families from {','.join(FAMILIES)}")
    if args.prompts < 2:
        parser.error("--prompts: pass 2 or more (a burst of one is one at a time)")
    if args.baseline == "comfyui" and only != ["flux"]:
        parser.error("--baseline comfyui runs the Flux template only: pass --only flux")
    fill_unset(args, {"device": "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"})
    fill_unset(args, {"dtype": "bfloat16" if args.device == "cuda" else "float32"})
    scale = TINY if args.tiny else GPU
    from omniloop.deploy import DeployConfig

    deploy = DeployConfig(device=args.device, dtype=args.dtype, max_batch=args.max_batch, max_queue=4 * args.prompts,
                          **({"compile": False} if args.no_compile else {}))
    templates = templates_dir(args.templates)
    scratch = Path(tempfile.mkdtemp(prefix="bench_comfy_"))
    sink = open(args.out, "a") if args.out else None
    try:
        for family in only:
            if args.baseline == "comfyui":
                bench_flux_servers(args, scale, deploy, templates, scratch, sink)
                continue
            bench_family(family, args, scale, deploy, templates, scratch, sink)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the random checkpoints, models folders, outputs
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    main()
