"""CUDA graphs on Flux's small-step path, on a GPU (never in CI): a tiny random Flux served
through the engine with ``cuda_graphs=True`` equals the same deployment without graphs,
bit for bit (``torch.equal``: a replay runs the captured kernels, the ones eager runs, on
the same inputs); later bursts of the same composition replay without new captures; steps
over the token threshold, LoRA steps and forwards that cannot be captured run eager."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from omniloop.cache.adapters import CACHE_NAME as ADAPTERS
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.models.layers.cuda_graphs import CACHE_NAME, CudaGraphRunner
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIZES = [(32, 32), (32, 48), (32, 32), (48, 32)]  # packed: mixed sizes share each step


@pytest.fixture(scope="module")
def options():
    return LoadOptions(device=torch.device("cuda"), dtype=torch.float32)


@pytest.fixture(scope="module")
def eager(flux_dir, options):
    return load_pipeline(flux_dir, options)[1]


@pytest.fixture()
def graphed(flux_dir, options):
    return load_pipeline(flux_dir, dataclasses.replace(options, cuda_graphs=True))[1]


def _req(i: int, h: int, w: int, loras=()) -> OmniRequest:
    return OmniRequest(request_id=f"r{i}", task=TaskType.T2I, inputs=[TextPart(text=f"a shape number {i}")],
                       diffusion=DiffusionParams(height=h, width=w, steps=3, seed=i, guidance_scale=3.5,
                                                 loras=list(loras)),
                       outputs=OutputSpec(return_latents=True))


def _burst(pipeline, sizes, loras=()):
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=8, max_running=8)))
    for i, (h, w) in enumerate(sizes):
        engine.add_request(_req(i, h, w, loras))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.status.value == "completed", out.error
            outs[out.request_id] = out.artifacts["latents"].latents
    return outs


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item():.3e}"


def _close(a, b):
    """Two *eager* runs of the two deployments: measured on the H200 (2026-12-01) to differ by
    up to 4.8e-7 (fp32, values ~2) on a 2-request mixed-size burst, cause not identified, while
    a graph replay against eager is bit-equal (the test above): so these compare within 1e-5."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


def test_engine_outputs_with_graphs_equal_eager_and_later_bursts_only_replay(eager, graphed):
    runner = graphed.caches[CACHE_NAME]
    want = _burst(eager, SIZES)
    _equal(_burst(graphed, SIZES), want)
    first = runner.summary()
    assert first["captures"] >= 1 and first["replays"] == 3  # 3 steps of one packed composition
    _equal(_burst(graphed, SIZES), want)  # the same composition again: replays only
    assert runner.summary()["captures"] == first["captures"] and runner.summary()["replays"] == 6
    _equal(_burst(graphed, SIZES[:1]), _burst(eager, SIZES[:1]))  # one image, another key


def test_threshold_and_lru_bound(eager, graphed):
    graphed.caches[CACHE_NAME].max_tokens = 1  # every step is "large": eager
    _close(_burst(graphed, SIZES[:2]), _burst(eager, SIZES[:2]))
    assert graphed.caches[CACHE_NAME].summary()["eager_large"] == 3 and graphed.caches[CACHE_NAME].summary()["graphs"] == 0
    small = CudaGraphRunner(max_graphs=1)
    graphed.caches[CACHE_NAME] = small
    object.__setattr__(graphed.spec.node("denoise").stage.denoiser, "graphs", small)
    _close(_burst(graphed, SIZES[:1]), _burst(eager, SIZES[:1]))
    _close(_burst(graphed, SIZES[1:2]), _burst(eager, SIZES[1:2]))  # another shape evicts the first graph
    assert small.summary()["evictions"] == 1 and small.summary()["graphs"] == 1


def test_lora_steps_stay_eager(eager, graphed, tmp_path):
    from tests.flux_checkpoint import save_flux_loras

    name, path = "detail", save_flux_loras(tmp_path)["detail"]  # a transformer-only adapter
    for p in (eager, graphed):
        p.caches[ADAPTERS].load(name, path)
    _close(_burst(graphed, SIZES[:2], loras=[(name, 0.7)]), _burst(eager, SIZES[:2], loras=[(name, 0.7)]))
    stats = graphed.caches[CACHE_NAME].summary()
    assert stats["captures"] == 0 and stats["replays"] == 0  # the per-row LoRA plan is never captured


def test_a_forward_that_cannot_be_captured_runs_eager_logged_once(caplog):
    runner = CudaGraphRunner()
    x = torch.arange(8.0, device="cuda")

    def syncs(t):  # .item() synchronizes the stream: not capturable
        return t["x"] * t["x"].sum().item()

    with caplog.at_level(logging.WARNING, logger="omniloop.models.layers.cuda_graphs"):
        for _ in range(3):
            assert torch.equal(runner.run(syncs, {"x": x}, structure=None, tokens=8), x * x.sum())
    assert runner.summary()["capture_failures"] == 1 and runner.summary()["eager_failed"] == 3
    assert sum("capture failed" in r.message for r in caplog.records) == 1
    # the device still works, and a capturable forward captures and replays
    assert torch.equal(runner.run(lambda t: t["x"] * 2, {"x": x}, structure="ok", tokens=8), x * 2)
    assert runner.summary()["captures"] == 1
