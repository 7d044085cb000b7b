"""A Wan denoise loop and a Qwen2 AR decode loop stepped alternately in one process, each on
its own RequestState: interleaving changes neither result (no state shared through modules,
global RNG or caches)."""

from __future__ import annotations

import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.offline import run_request
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import start, text_request


def _wan_request():
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle")],
                       diffusion=DiffusionParams(seed=3, steps=4, height=32, width=32, num_frames=5),
                       outputs=OutputSpec(return_latents=True))


@torch.inference_mode()
def test_denoise_and_decode_loops_interleave_without_interference(wan_t2v_dir, qwen2_pipeline):
    wan = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32").pipeline
    ar_request = text_request(PROMPTS[3], max_tokens=10, temperature=0.8, top_k=30, seed=5)
    wan_alone = run_request(wan, _wan_request())
    ar_alone = run_request(qwen2_pipeline, ar_request)
    assert wan_alone.status.value == ar_alone.status.value == "completed"

    wan_state = wan.admit(_wan_request())
    wan.spec.node("text_encode").stage.forward(wan.contexts["text_encode"], wan_state)
    denoise, wan_ctx = wan.spec.node("denoise").stage, wan.contexts["denoise"]
    wan_loop = denoise.init(wan_ctx, wan_state)
    ar_state, decode, ar_ctx, ar_loop = start(qwen2_pipeline, ar_request)
    torch.manual_seed(12345)  # the global RNG is nobody's state: disturbing it changes nothing
    while not (wan_loop.done and ar_loop.done):
        for stage, ctx, loop in ((denoise, wan_ctx, wan_loop), (decode, ar_ctx, ar_loop)):
            if not loop.done:
                stage.step(ctx, loop)
                torch.rand(3)
    decode.finalize(ar_ctx, ar_loop, ar_state)
    assert torch.equal(wan_loop.latents["video"], wan_alone.artifacts["latents"].latents)
    assert ar_state.artifacts["text"].token_ids == ar_alone.text.token_ids
    assert ar_state.artifacts["text"].text == ar_alone.text.text
