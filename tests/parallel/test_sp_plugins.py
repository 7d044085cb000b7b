"""Cache plugins under sequence parallelism, through the real pool: the block interceptor
runs on each rank's token shard and its decision statistics are reduced over the sp group
(``ext/reduce.py group_mean``), so both ranks skip the same blocks at the same steps —
the same decisions the one-process run takes on the whole sequence.

That shard-local statistics alone disagree (the hazard this prevents) is shown on scripted
residuals in tests/ext/test_reduce.py; here each rank's shard holds half of the tokens.
"""

from __future__ import annotations

import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, threads

PLUGINS = {"fbcache": {"threshold": 0.3, "warmup_steps": 2}}


def _request():
    return OmniRequest(task=TaskType.T2V, request_id="cached", inputs=[TextPart(text="a blue square")],
                       outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(steps=10, height=32, width=64, num_frames=5, seed=1, guidance_scale=4.0))


def test_every_rank_takes_the_one_process_decisions(wan_t2v_dir):
    one = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", plugins=PLUGINS)
    with torch.inference_mode(), threads(rank_threads(2)):
        expected = one.generate(_request())
    expected_metrics = one.engine.plugin_metrics()["fbcache"]
    assert 0 < expected_metrics["skipped"] < expected_metrics["forwards"], "the threshold should cache some steps"
    with VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", plugins=PLUGINS, parallel="sp=2") as gen:
        out = gen.generate(_request())
        per_rank = [m["fbcache"] for m in gen.engine.rank_plugin_metrics()]
    assert per_rank[0] == per_rank[1], "both ranks decided alike (reduced statistics)"
    assert (per_rank[0]["forwards"], per_rank[0]["skipped"]) == (expected_metrics["forwards"], expected_metrics["skipped"])
    diff = (out.artifacts["latents"].latents - expected.artifacts["latents"].latents).abs().max().item()
    assert diff < 1e-5, diff  # the same blocks ran; only the reduction order of the statistics differs
