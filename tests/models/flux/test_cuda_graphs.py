"""CUDA graphs on Flux's small-step path (models/layers/cuda_graphs.py), the CPU side:
the runner's keying, LRU and threshold logic (plain Python), the ``cuda_graphs`` option's
validation and threading, and the Flux step routed through the runner (eager on a CPU,
counted, and bit-equal to the path without it). The GPU side (capture, replay, equality
through the engine) is tests/models/flux/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.cli import _deploy_from_flags, build_parser
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.models.families.flux.spec import flux_pipeline_spec, flux_variant, graph_runner
from omniloop.models.layers.cuda_graphs import CACHE_NAME, CudaGraphRunner, GraphLRU, graph_key
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

CUDA = torch.device("cuda")  # a device object only: nothing here runs on it


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def test_graph_key_separates_every_static_part_of_a_call():
    base = graph_key(((4,), (8,)), {"image": _t(4, 16), "text": _t(8, 32)})
    assert base == graph_key(((4,), (8,)), {"text": _t(8, 32), "image": _t(4, 16)})  # order of names does not matter
    assert base != graph_key(((4,), (9,)), {"image": _t(4, 16), "text": _t(8, 32)})  # packed lengths
    assert base != graph_key(((4,), (8,)), {"image": _t(5, 16), "text": _t(8, 32)})  # a shape
    assert base != graph_key(((4,), (8,)), {"image": _t(4, 16, dtype=torch.bfloat16), "text": _t(8, 32)})  # dtype
    assert base != graph_key(((4,), (8,)), {"image": _t(4, 16), "text": _t(8, 32), "guidance": _t(1)})  # an input present


def test_graph_lru_evicts_the_least_recently_used_beyond_its_count():
    lru = GraphLRU(2)
    assert lru.put("a", 1) == [] and lru.put("b", 2) == []
    assert lru.get("a") == 1  # a is now the most recent
    assert lru.put("c", 3) == [2] and lru.keys() == ["a", "c"]
    assert lru.get("b") is None and len(lru) == 2
    with pytest.raises(ValueError, match="capacity >= 1"):
        GraphLRU(0)


def test_runner_routes_by_device_threshold_cache_and_failure():
    runner = CudaGraphRunner(max_graphs=1, max_tokens=100)
    assert runner.route("k", 10, torch.device("cpu")) == "not_cuda"
    assert runner.route("k", 101, CUDA) == "large"  # over the small-image threshold: eager
    assert runner.route("k", 100, CUDA) == "capture"
    runner.graphs.put("k", object())
    assert runner.route("k", 100, CUDA) == "replay"
    runner.graphs.put("k2", object())  # the LRU bound (1) drops k: the next call of k captures again
    assert runner.route("k", 100, CUDA) == "capture" and runner.route("k2", 100, CUDA) == "replay"
    runner.clear()  # the weights moved: every graph is stale
    assert runner.route("k2", 100, CUDA) == "capture" and runner.summary()["graphs"] == 0
    for bad in ({"max_tokens": 0}, {"warmup": 0}, {"max_graphs": 0}):
        with pytest.raises(ValueError):
            CudaGraphRunner(**bad)


def test_runner_on_cpu_runs_the_forward_eager_and_counts_it():
    runner = CudaGraphRunner()
    x = torch.arange(6.0)
    out = runner.run(lambda t: t["x"] * 2, {"x": x}, structure=None, tokens=6)
    assert torch.equal(out, x * 2) and runner.summary() == {**runner.summary(), "eager_not_cuda": 1, "captures": 0}


def test_cuda_graphs_option_is_refused_off_cuda_naming_the_field():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA GPU.*--cuda-graphs"):
        DeployConfig(device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        graph_runner(LoadOptions(device=torch.device("cpu"), dtype=torch.float32, cuda_graphs=True))
    assert graph_runner(LoadOptions(device=torch.device("cpu"), dtype=torch.float32)) is None  # off: nothing built
    runner = graph_runner(LoadOptions(device=CUDA, dtype=torch.bfloat16, cuda_graphs=True, cuda_graph_max_tokens=999,
                                      cuda_graph_max_graphs=3))
    assert (runner.max_tokens, runner.max_graphs) == (999, 3)


def test_cuda_graph_flags_reach_the_load_options():
    args = build_parser().parse_args(["generate", "x", "--device", "cpu",
                                      "--cuda-graph-max-tokens", "4096", "--cuda-graph-max-graphs", "2"])
    opts = load_options(_deploy_from_flags(args))
    assert (opts.cuda_graphs, opts.cuda_graph_max_tokens, opts.cuda_graph_max_graphs) == (False, 4096, 2)
    args = build_parser().parse_args(["generate", "x", "--device", "cpu", "--cuda-graphs"])
    with pytest.raises(ValueError, match="cuda_graphs"):
        _deploy_from_flags(args)


def _req(i: int, h: int, w: int) -> OmniRequest:
    return OmniRequest(request_id=f"r{i}", task=TaskType.T2I, inputs=[TextPart(text=f"a shape number {i}")],
                       diffusion=DiffusionParams(height=h, width=w, steps=2, seed=i), outputs=OutputSpec(return_latents=True))


def _latents(pipeline, sizes):
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=8, max_running=8)))
    for i, (h, w) in enumerate(sizes):
        engine.add_request(_req(i, h, w))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.status.value == "completed", out.error
            outs[out.request_id] = out.artifacts["latents"].latents
    return outs


def test_flux_step_through_the_runner_equals_the_plain_step(flux_dir):
    """The graphed path's plumbing (tensors out of FluxInputs, the forward rebuilt from them)
    on a CPU: every forward reaches the runner, runs eager there, and is bit-equal."""
    _, plain = load_pipeline(flux_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    runner = CudaGraphRunner()
    spec = flux_pipeline_spec(flux_variant({}), guidance_embeds=plain.components["transformer"].config.guidance_embeds,
                              graphs=runner)
    graphed = Pipeline(spec=spec, components=plain.components, device=plain.device, dtype=plain.dtype,
                       defaults=plain.defaults, validate_request=plain.validate_request,
                       caches={**plain.caches, CACHE_NAME: runner})
    sizes = [(32, 32), (32, 48)]
    want, got = _latents(plain, sizes), _latents(graphed, sizes)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert runner.stats.eager_not_cuda == 2  # 2 steps, both sizes packed in each
