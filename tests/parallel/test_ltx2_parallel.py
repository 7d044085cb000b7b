"""LTX-2 on 2 gloo ranks through the pool equals one process (models/families/ltx2/parallelize.py):
with its four guidance branches on (CFG, STG, modality isolation; the presets' scales), cfg=2 puts
cond + stg on one rank and uncond + modality on the other, and the video and audio latents are
bit for bit the one-process sequential run's. sp and tp are refused before any weight loads,
naming the joint two-stream blocks."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.parallel.spec import ParallelSpec
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, threads


def _request():
    return OmniRequest(task=TaskType.T2V, request_id="clip", inputs=[TextPart(text="a red circle moving right")],
                       node_params={"denoise": {"stg_blocks": [1]}}, outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(steps=2, seed=3, height=64, width=64, num_frames=9,
                                                 negative_prompt="worst quality"))


def _latents(out):
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents, out.artifacts["audio_latents"].latents


def test_ltx2_guidance_branches_on_two_ranks_equal_one_process(ltx2_dir):
    one = VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32", cfg_mode="sequential")
    request = _request()
    loop = next(n.stage for n in one.pipeline.spec.nodes if n.name == "denoise")
    admitted = one.pipeline.admit(request)  # the node's guidance, resolved at admission
    ctx = one.pipeline.contexts["denoise"]
    state = loop.cfg.init(loop.params(ctx, admitted), ("video", "audio"), admitted.node_params["denoise"])
    assert state.branches == ("cond", "uncond", "stg", "modality")  # the presets' scales turn all four on
    with torch.inference_mode(), threads(rank_threads(2)):
        video, audio = _latents(one.generate(request))
    with VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32", cfg_mode="sequential",
                                        parallel="cfg=2") as gen:
        got_video, got_audio = _latents(gen.generate(request))
    assert torch.equal(got_video, video) and torch.equal(got_audio, audio)


def test_ltx2_preflight_refuses_sp_and_tp_naming_the_two_streams(ltx2_dir):
    facts = model_facts(ltx2_dir)
    assert facts.family == "ltx2"
    check_model(ParallelSpec.from_flag("cfg=2,dp=2"), facts)
    with pytest.raises(ValueError, match=r"sp=2: the LTX-2 blocks carry two token streams.*parallel='dp=2'"):
        check_model(ParallelSpec.from_flag("ulysses=2"), facts)
    with pytest.raises(ValueError, match=r"tp=2: LTX-2 has no tensor-parallel plan.*parallel='dp=2,cfg=2'"):
        check_model(ParallelSpec.from_flag("tp=2,cfg=2"), facts)
