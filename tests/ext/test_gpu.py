"""GPU checks of the extension system (marked ``gpu``; run through the device tool):
per-request cache state on CUDA in bf16, and the profiler's CUDA-event times."""

from __future__ import annotations

import pytest
import torch

from omniloop.ext import install_plugins, installed_plugins
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from tests.ext.factories import MemoText, drive, request, run_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_pipeline(path, cfg_mode: str = "sequential"):
    pipeline = load_pipeline(path, LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, cfg_mode=cfg_mode))[1]
    pipeline.components["text_encoder"] = MemoText(pipeline.components["text_encoder"])
    return pipeline


@pytest.mark.parametrize("plugins", [
    {"fbcache": {"threshold": 0.1, "warmup_steps": 2, "taylorseer_order": 1}},
    {"teacache": {"model": "identity", "threshold": 0.4, "ret_steps": 2}},
], ids=["fbcache", "teacache"])
def test_interleaved_equals_solo_on_cuda(wan_t2v_dir, plugins):
    pipe = install_plugins(cuda_pipeline(wan_t2v_dir, "batched"), plugins)
    a, b = request(0, steps=12), request(1, steps=16)
    solo = {**drive(pipe, [a]).latents, **drive(pipe, [b]).latents}
    together = drive(pipe, [a, b])
    for rid, latents in solo.items():
        assert torch.equal(together.latents[rid], latents)
        assert together.plugins[rid][next(iter(plugins))].skipped > 0
    outs, engine = run_engine(pipe, [a, b], max_batch=4)
    assert engine.stats.batched_steps > 0
    for rid, latents in solo.items():
        assert torch.allclose(outs[rid].artifacts["latents"].latents, latents, atol=2e-2)


def test_profiler_reports_cuda_event_times(wan_t2v_dir):
    pipe = install_plugins(cuda_pipeline(wan_t2v_dir), {"profiler": {}})
    _, engine = run_engine(pipe, [request(0, steps=3)])
    torch.cuda.synchronize()
    m = installed_plugins(pipe).chain.metrics()["profiler"]
    assert m["cuda_step_s"]["denoise"]["count"] == 3
    assert m["cuda_block_s"]["transformer.blocks.0"]["count"] == 6 and m["peak_memory_bytes"] > 0
    assert engine.plugin_metrics()["profiler"]["step_s"]["denoise"]["count"] == 3
