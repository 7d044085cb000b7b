"""One engine, one pipeline with both loop kinds: AR decode steps (a Qwen2-class LM) and
denoise steps (Wan) of concurrent requests are interleaved and batched by the scheduler,
and each request's output equals its solo run."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig
from omniloop.models.loader import load_pipeline
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.predicates import task_in
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.request import OmniRequest, RequestStatus, SamplingParams, TaskType, TextPart
from tests.engine.conftest import OPTS, req, run_all
from tests.engine_plans import run_recorded


@pytest.fixture(scope="module")
def hybrid(wan_t2v_dir, qwen2_dir):
    _, wan = load_pipeline(wan_t2v_dir, OPTS)
    _, lm = load_pipeline(qwen2_dir, OPTS)
    t2v, reason = task_in(TaskType.T2V), task_in(TaskType.REASON)
    nodes = [Node("reason", lm.spec.node("decode").stage, when=reason, outputs={"text": "reason_text"})]
    # Wan's nodes for t2v, each still under its own predicate (v2v's video encode drops out)
    nodes += [Node(n.name, n.stage, when=t2v if n.when is None else t2v & n.when, inputs=n.inputs, outputs=n.outputs)
              for n in wan.spec.nodes if n.may_run_for(TaskType.T2V)]
    spec = PipelineSpec(
        name="hybrid", family="test", tasks=frozenset({TaskType.T2V, TaskType.REASON}),
        components={**wan.spec.components, **lm.spec.components}, nodes=tuple(nodes),
        outputs={**wan.spec.outputs, "text": "reason_text"},
    )

    def validate(request):
        return (wan if request.task is TaskType.T2V else lm).validate_request(request)

    return Pipeline(spec=spec, components={**wan.components, **lm.components}, device=wan.device, dtype=wan.dtype,
                    defaults=wan.defaults.replace(text=lm.defaults.text), validate_request=validate)


def _text_req(i, n=12):
    return OmniRequest(task=TaskType.REASON, request_id=f"txt{i}", inputs=[TextPart(text=f"a red circle {i}")],
                       sampling=SamplingParams(max_tokens=n, temperature=0.0))


def test_scheduler_mixes_ar_decode_and_denoise_steps(hybrid):
    requests = [_text_req(0), _text_req(1, n=8), req(1, steps=6, rid="vid0"), req(2, steps=6, rid="vid1")]
    outs, plans = run_recorded(hybrid, requests)
    assert all(o.status is RequestStatus.COMPLETED for o in outs.values())
    steps = plans.steps()
    kinds = [w.node for w in steps]
    # both loop kinds ran, interleaved (not one kind to completion then the other)
    assert {"reason", "denoise"} <= set(kinds)
    first_denoise, last_reason = kinds.index("denoise"), len(kinds) - 1 - kinds[::-1].index("reason")
    assert first_denoise < last_reason
    # decode steps of the two text requests were batched, and so were the two videos' steps
    assert any(w.node == "reason" and len(w.request_ids) == 2 for w in steps)
    assert any(w.node == "denoise" and len(w.request_ids) == 2 for w in steps)

    solo, _ = run_recorded(hybrid, [_text_req(0)])
    assert outs["txt0"].text.token_ids == solo["txt0"].text.token_ids
    solo, _ = run_recorded(hybrid, [req(1, steps=6, rid="vid0")])
    # batched vs solo DiT forward: not bit-exact on the CPU, measured 1.3e-6 after 6 steps
    assert torch.allclose(outs["vid0"].artifacts["latents"].latents, solo["vid0"].artifacts["latents"].latents, atol=5e-6)


def test_cancelling_an_ar_request_frees_its_kv(hybrid):
    engine = Engine(hybrid, EngineConfig())
    engine.add_request(_text_req(5, n=30))
    with torch.inference_mode():
        for _ in range(4):
            engine.step()
        loop = engine._requests["txt5"].loop
        assert loop is not None and loop.kv.nbytes > 0
        engine.abort("txt5")
        outs, _ = run_all(engine)
    assert outs["txt5"].status is RequestStatus.CANCELLED
    assert loop.kv.nbytes == 0
