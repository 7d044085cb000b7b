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
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import queue
import shutil
import socket
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

from common import emit, fill_unset  # noqa: E402

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
    before = engine.stats()
    runs = (burst if mode == "burst" else one_at_a_time)(client, prompts, timeout)
    after = engine.stats()
    latencies = [end - t0 for _, t0, end in runs]
    waits, saves = zip(*(client.phases(pid, t0) for pid, t0, _ in runs))
    wall = max(end for _, _, end in runs) - min(t0 for _, t0, _ in runs)
    engine_steps = after["steps"] - before["steps"]
    return {"mode": mode, "prompts": len(prompts), "wall_s": round(wall, 3), "per_s": round(len(prompts) / wall, 4),
            "latency_p50_s": round(percentile(latencies, 0.5), 3), "latency_p95_s": round(percentile(latencies, 0.95), 3),
            "latency_mean_s": round(sum(latencies) / len(latencies), 3),
            # POST -> first step (queued behind others), and the output nodes' file writing, per prompt
            "wait_to_first_step_mean_s": round(sum(waits) / len(waits), 3), "save_mean_s": round(sum(saves) / len(saves), 3),
            "engine_steps": engine_steps, "batched_steps": after["batched_steps"] - before["batched_steps"],
            "mean_batch": round(len(prompts) * steps / engine_steps, 2),  # the prompts' denoise steps per engine step
            "files": checked_files(client, runs, mode), "runs": runs}


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
    head = {"bench": "comfy_burst", "family": family, "template": FLUX_TEMPLATE if family == "flux" else WAN_TEMPLATE,
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
    args = parser.parse_args()
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    if not only or set(only) - set(FAMILIES):
        parser.error(f"--only {args.only!r}: pass families from {','.join(FAMILIES)}")
    if args.prompts < 2:
        parser.error("--prompts: pass 2 or more (a burst of one is one at a time)")
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
