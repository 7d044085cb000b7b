"""FAR (the causal Wan over chunk-KV slabs) on 2 gloo ranks through the pool equals one
process: its chunk rollout's inner denoise steps split their (request, CFG branch) forwards
across the rows (models/families/far/parallelize.py), the context pass writes every branch's
slabs on every rank. cfg=2 (the cond and uncond forwards of each step on two ranks) is bit for
bit; dp=2 (two requests of one batched step, one per rank) within 1e-5 (one row per forward
rounds differently from two in one forward). sp and tp are refused before
any weight loads, naming the chunk-KV slabs. A session's live input (``Engine.send``) is
refused by a pool: the plans carry none, so only rank 0's loop would see it."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.parallel.spec import ParallelSpec
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, threads

PARAMS = dict(height=32, width=64, num_frames=17, steps=2, guidance_scale=3.0, negative_prompt="low quality")


def _request(rid="clip", seed=7):
    return OmniRequest(request_id=rid, task=TaskType.T2V, inputs=[TextPart(text=f"a red circle {seed}")],
                       diffusion=DiffusionParams(**PARAMS, seed=seed), outputs=OutputSpec(return_latents=True))


def _run_all(engine, requests):
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return {r.request_id: engine.pop_output(r.request_id) for r in requests}


REQUESTS = ("a", 1), ("b", 2)


@pytest.fixture(scope="module")
def one_process(far_dir):
    gen = VideoGenerator.from_pretrained(far_dir, device="cpu", dtype="float32")
    with torch.inference_mode(), threads(rank_threads(2)):
        solo = gen.generate(_request()).artifacts["latents"].latents
        batched = {k: o.artifacts["latents"].latents for k, o in
                   _run_all(gen.engine, [_request(*a) for a in REQUESTS]).items()}
    return solo, batched


@pytest.mark.parametrize("spec", ["cfg=2", "dp=2"])
def test_far_rows_through_the_pool_equal_one_process(far_dir, one_process, spec):
    solo, batched = one_process
    with VideoGenerator.from_pretrained(far_dir, device="cpu", dtype="float32", parallel=spec) as gen:
        if spec == "cfg=2":
            out = gen.generate(_request())
            assert out.status.value == "completed", out.error
            assert torch.equal(out.artifacts["latents"].latents, solo)
            return
        with pytest.raises(ValueError, match=r"live inputs to a running request .* not sent to the other ranks"):
            gen.engine.send("a", TextPart(text="turn left"))  # a session's input would reach rank 0 only
        with torch.inference_mode():
            outs = _run_all(gen.engine, [_request(*a) for a in REQUESTS])
        assert gen.engine.stats.batched_steps > 0
    for rid, out in outs.items():
        assert out.status.value == "completed", out.error
        err = (out.artifacts["latents"].latents - batched[rid]).abs().max().item()
        assert err < 1e-5  # one row per rank vs two rows in one forward: the GEMMs block differently


def test_far_preflight_refuses_sp_and_tp_naming_the_chunk_kv(far_dir):
    facts = model_facts(far_dir)
    assert facts.family == "far"
    check_model(ParallelSpec.from_flag("cfg=2,dp=2"), facts)
    with pytest.raises(ValueError, match=r"sp=2: the causal self-attention writes each chunk's K/V into the "
                                         r"request's chunk-KV slabs.*parallel='dp=2'"):
        check_model(ParallelSpec.from_flag("sp=2"), facts)
    with pytest.raises(ValueError, match=r"tp=2: .*chunk-KV slabs.*parallel='dp=2,cfg=2'"):
        check_model(ParallelSpec.from_flag("cfg=2,tp=2"), facts)



def test_the_interactive_far_layout_has_the_same_plan():
    from omniloop.models.families.far.spec import FAR, FAR_MANIFEST
    from omniloop.parallel.plan import parallel_plan

    assert parallel_plan(FAR_MANIFEST) is parallel_plan(FAR) is not None  # one model, one set of loops
