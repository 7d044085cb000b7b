"""Startup that fails loudly: the default warmup shape is one the model can run; a warmup
that fails stops ``omniloop serve`` with a non-zero exit and an error naming the shape and
the cause (it used to log and stay up, never ready); the server says where it listens."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from omniloop.deploy import Limits
from omniloop.engine import AsyncEngine
from omniloop.request import DiffusionParams, TaskType
from omniloop.serve.warmup import default_shape, warmup_shapes
from tests.serve.conftest import live_server

VIDEO = frozenset({TaskType.T2V, TaskType.T2I})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, *flags: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    command = [sys.executable, "-m", "omniloop.api.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--device", "cpu", "--dtype", "float32", *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), port


def test_default_warmup_shape_is_the_models_own_clamped_to_what_it_serves(wan_t2v_dir):
    engine = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    try:
        defaults = engine.engine.pipeline.defaults
    finally:
        engine.shutdown()
    # Wan's 480x832x81 default; the tiny DiT's RoPE table (32 tokens a side) caps the width
    # at 32 tokens x patch 2 x VAE 8 = 512 pixels (the old default warmup ran 832 and failed)
    assert (defaults.max_height, defaults.max_width, defaults.max_frames) == (512, 512, 125)
    shape = default_shape(defaults, Limits(), VIDEO)
    assert (shape.height, shape.width, shape.num_frames, shape.steps) == (480, 512, 81, 2)
    # the deployment's ceilings clamp it too: pixels keep the aspect ratio on the 16-pixel grid,
    # frames stay 4k+1
    small = default_shape(defaults, Limits(max_pixels=64 * 64, max_frames=11, max_steps=1), VIDEO)
    assert (small.height, small.width, small.num_frames, small.steps) == (48, 64, 9, 1)
    assert default_shape(defaults, Limits(), frozenset({TaskType.T2I})).num_frames == 1
    # configured shapes keep what they set and take the rest from the clamped default
    (one,) = warmup_shapes([DiffusionParams(steps=1)], defaults, Limits(), VIDEO)
    assert (one.height, one.width, one.num_frames, one.steps) == (480, 512, 81, 1)
    assert warmup_shapes([], defaults, Limits(), VIDEO) == []


@pytest.mark.slow
def test_serve_prints_its_address_warms_up_at_the_default_shape_and_exits_0(wan_t2v_dir):
    proc, port = _serve(wan_t2v_dir, "--limits", json.dumps({"max_pixels": 32 * 32, "max_frames": 5}))
    try:
        first = proc.stdout.readline()  # printed once uvicorn listens
        url = f"http://127.0.0.1:{port}"
        assert first.startswith(f"omniloop serve: {wan_t2v_dir.name} on {url} (OpenAI base_url {url}/v1)"), first
        assert proc.stdout.readline().strip() == "omniloop serve: ready"
        assert httpx.get(f"{url}/ready").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_refused_warmup_exits_1_naming_the_shape_and_the_cause(wan_t2v_dir):
    proc, _ = _serve(wan_t2v_dir, "--warmup-size", "40x32", "--warmup-frames", "5")
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == (
        "error: warmup shape 0 (steps=2 height=32 width=40 num_frames=5) was refused: "
        "diffusion.width=40 must be a multiple of 16; pass 32 or 48")


def _failed_warmup(model_dir, shape: DiffusionParams, **deploy) -> str:
    """The in-process twin of the CLI's exit: the uvicorn thread stops, the error is kept."""
    with live_server(model_dir, serve={"warmup": [shape]}, wait=False, **deploy) as live:
        live.thread.join(timeout=120)
        assert not live.thread.is_alive(), "the server kept running after its warmup failed"
        assert not live.state.warmed
        return live.state.warmup_error


def test_a_warmup_that_fails_while_running_stops_the_server(wan_t2v_dir):
    shape = DiffusionParams(steps=2, height=32, width=32, num_frames=5, guidance_scale=1e300)  # overflows
    error = _failed_warmup(wan_t2v_dir, shape)
    assert error.startswith("warmup shape 0 (steps=2 guidance_scale=1e+300 height=32 width=32 num_frames=5) "
                            "failed: non-finite values (NaN/Inf) in node 'denoise'"), error


def test_a_configured_warmup_goes_through_the_same_admission(wan_t2v_dir):
    error = _failed_warmup(wan_t2v_dir, DiffusionParams(steps=8, height=32, width=32, num_frames=5),
                           limits={"max_steps": 4})
    assert error == ("warmup shape 0 (steps=8 height=32 width=32 num_frames=5) was refused: diffusion.steps: 8 steps "
                     "exceed this deployment's limit of 4 (limits.max_steps); pass fewer steps")


@pytest.mark.slow
def test_a_compiled_server_compiles_its_warmup_shape_before_ready_and_saves_the_cache(wan_t2v_dir, tmp_path):
    """``--compile`` on a CPU (Inductor C++): the warmup compiles the blocks before ``ready``
    is printed, and what it compiled is in the compile cache when the server answers ready."""
    cache = tmp_path / "compile"
    proc, port = _serve(wan_t2v_dir, "--limits", json.dumps({"max_pixels": 32 * 32, "max_frames": 5}),
                        "--warmup-steps", "1", "--compile", "--compile-cache-dir", str(cache))
    try:
        proc.stdout.readline()  # the address
        assert proc.stdout.readline().strip() == "omniloop serve: ready"
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
        (saved,) = cache.glob("*/*/*.artifacts")  # model key / versions key / the warmup's bucket
        assert saved.name.startswith("steps_1_height_")  # the bucket: the warmup shape it compiled
        assert any((cache / "inductor").iterdir())  # Inductor's own cache, in the same folder
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
