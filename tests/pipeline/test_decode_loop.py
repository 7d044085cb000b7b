"""The video decode loop (pipeline/loops/decode.py): a large Wan VAE decode runs as steps,
bit-equal to the one-shot node's decode, seen from outside as that node."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omniloop.engine import Engine, EngineConfig
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.loops.decode import VideoDecodeLoop, causal_cache_bytes
from omniloop.pipeline.stages.decode import latents_to_unit_range, to_uint8_frames
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, ProgressEvent, TaskType, TextPart

OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def wan(wan_t2v_dir):
    return load_pipeline(wan_t2v_dir, OPTS)[1]


def _streaming(pipeline, **thresholds):
    """``pipeline`` with its decode loop streaming tiny clips (the tiny checkpoint's clips are
    far below the default threshold), one latent frame a step."""
    node = pipeline.spec.node("decode")
    stage = dataclasses.replace(node.stage, **thresholds)
    spec = dataclasses.replace(pipeline.spec, nodes=tuple(dataclasses.replace(n, stage=stage) if n is node else n
                                                          for n in pipeline.spec.nodes))
    return dataclasses.replace(pipeline, spec=spec)


def _request(frames=17, size=32, steps=2, rid=None):
    extra = {"request_id": rid} if rid else {}
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle")], outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(seed=3, steps=steps, height=size, width=size, num_frames=frames), **extra)


def test_a_streamed_decode_equals_the_one_shot_decode_and_looks_like_it(wan):
    pipeline = _streaming(wan, stream_above_pixels=0, step_pixels=1)
    assert pipeline.spec.node("decode").stage.whole is False  # diffusers' per-frame decode
    events = []
    engine = Engine(pipeline, EngineConfig(), event_sink=events.append)
    rid = engine.add_request(_request())
    est = engine._requests[rid].info["estimates"]["decode"]
    out = engine.run_until_done(rid)
    assert out.status.value == "completed", out.error
    latents = out.artifacts["latents"].latents  # [1, C, 5, h, w]
    assert est.steps == latents.shape[2] == 5 and est.loop_bytes > 0
    vae = pipeline.components["vae"]
    one_shot = to_uint8_frames(latents_to_unit_range(vae, latents, False)[0])
    assert torch.equal(out.video.frames, one_shot)
    assert out.video.node == "decode" and out.metrics.steps == 2  # the denoise steps only
    assert {e.node for e in events if isinstance(e, ProgressEvent)} == {"denoise"}


def test_a_small_decode_is_one_step_of_the_one_shot_decode(wan):
    stage = wan.spec.node("decode").stage
    vae = wan.components["vae"]
    plan = stage.plan(vae, (1, 16, 5, 4, 4), _request())
    assert not plan.streamed
    big = stage.plan(vae, (1, 16, 9, 32, 32), _request(frames=33, size=256))
    assert big.streamed and big.frames_per_step == 1 and big.steps == 9
    image = OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="x")])
    assert stage.plan(vae, (1, 16, 1, 32, 32), image).steps == 1


def test_the_causal_cache_estimate_is_the_cache_the_stream_holds(wan):
    vae = wan.components["vae"]
    z = torch.randn(1, vae.config.z_dim, 3, 4, 6)
    cache = vae.new_stream()
    with torch.inference_mode():
        vae.decode_stream(z, cache)
    held = sum(t.numel() * t.element_size() for t in cache._slots if t is not None)
    est = causal_cache_bytes(vae.config, tuple(z.shape), vae.dtype)
    assert held / 2 <= est <= 2 * held, (held, est)
