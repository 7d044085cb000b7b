"""Hybrid Cosmos3 requests on one resident transformer: a streamed REASON request, prompt
upsampling feeding the generator's text segment in the same request, and an interleaved
trace where the scheduler mixes (and batches) reasoner decode steps and denoise steps of
different requests -- each request equal to its solo run."""

from __future__ import annotations

import pytest
import torch

from omniloop.request import (
    ArtifactEvent, DiffusionParams, OmniRequest, OutputSpec, RequestStatus, SamplingParams, TaskType, TextPart,
)
from tests.engine_plans import run_recorded

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def _reason(rid, prompt="a robot arm picks up a cube", stream=False):
    return OmniRequest(task=TaskType.REASON, request_id=rid, inputs=[TextPart(text=prompt)], sampling=GREEDY,
                       outputs=OutputSpec(stream=stream))


def _video(rid, prompt="a red circle moving right", task=TaskType.T2V, **denoise):
    return OmniRequest(task=task, request_id=rid, inputs=[TextPart(text=prompt)], sampling=GREEDY,
                       diffusion=DiffusionParams(height=64, width=64, num_frames=9, steps=3, guidance_scale=3.0, seed=3),
                       outputs=OutputSpec(return_latents=True), node_params={"denoise": denoise} if denoise else {})


def _run(pipeline, requests, **policy):
    events: list = []
    outs, plans = run_recorded(pipeline, requests, events=events, **policy)
    return outs, plans, events


def test_reason_streams_text_deltas(cosmos3_pipeline):
    outs, _, events = _run(cosmos3_pipeline, [_reason("r", stream=True)])
    final = outs["r"].text
    deltas = [e.artifact for e in events if isinstance(e, ArtifactEvent) and e.partial and e.name == "text_delta"]
    assert len(deltas) >= 2 and "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids


def test_prompt_upsampling_feeds_the_generator_in_the_same_request(cosmos3_pipeline):
    outs, plans, _ = _run(cosmos3_pipeline, [_video("up", upsample_prompt=True)])
    out = outs["up"]
    assert out.status is RequestStatus.COMPLETED
    upsampled = out.artifacts["text"]
    assert upsampled.node == "upsample" and len(upsampled.token_ids) == GREEDY.max_tokens
    nodes = [w.node for w in plans.works()]
    assert nodes.index("upsample") < nodes.index("tokenize") < nodes.index("denoise")
    # the same request without upsampling, prompted with the reasoner's text: the same video
    plain, _, _ = _run(cosmos3_pipeline, [_video("plain", prompt=upsampled.text)])
    assert torch.equal(out.artifacts["latents"].latents, plain["plain"].artifacts["latents"].latents)


@pytest.mark.slow  # ~45 s on 2 shared cores: five requests, each also run solo
def test_interleaved_trace_mixes_and_batches_both_loop_kinds(cosmos3_pipeline):
    trace = [_reason("txt0"), _video("vid0"), _reason("txt1", "hello world, the cat sat on the mat"),
             _video("vid1", "a robot arm picks up a cube"), _video("snd", task=TaskType.T2VS)]
    outs, plans, _ = _run(cosmos3_pipeline, trace)
    assert all(o.status is RequestStatus.COMPLETED for o in outs.values()), {k: o.error for k, o in outs.items()}
    steps = plans.steps()
    kinds = [w.node for w in steps]
    first_denoise, last_reason = kinds.index("denoise"), len(kinds) - 1 - kinds[::-1].index("reason")
    assert first_denoise < last_reason  # interleaved, not one kind to completion then the other
    assert any(w.node == "reason" and len(w.request_ids) == 2 for w in steps)
    assert any(w.node == "denoise" and len(w.request_ids) == 2 for w in steps)  # the two T2V requests
    for r in trace:
        solo = _run(cosmos3_pipeline, [r])[0][r.request_id]
        if r.task is TaskType.REASON:
            assert outs[r.request_id].text.token_ids == solo.text.token_ids
        else:
            torch.testing.assert_close(outs[r.request_id].artifacts["latents"].latents,
                                       solo.artifacts["latents"].latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(outs["snd"].audio.samples, _run(cosmos3_pipeline, [trace[-1]])[0]["snd"].audio.samples,
                               rtol=0, atol=1e-5)
