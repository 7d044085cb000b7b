"""The AR loop on the paged text KV, through the engine: prefill chunked under a token
budget, decode steps of many requests batched, preemption by recompute when the pool is
full (every request still produces its solo tokens), a pool too small for one request
refused at submission."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, RequestRejected, SchedulerPlan, SchedulingPolicy, StepWork
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import RequestStatus
from tests.engine_plans import record_plans
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import text_request, with_defaults

BLOCK_BYTES = 16 * 2 * 2 * 2 * 8 * 4  # 16 tokens x (K, V) x 2 layers x 2 kv heads x head_dim 8 x fp32


def _pipeline(qwen2_dir, blocks=None, **defaults):
    gb = None if blocks is None else blocks * BLOCK_BYTES / 2**30
    _, pipeline = load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32, kv_cache_gb=gb))
    return with_defaults(pipeline, **defaults) if defaults else pipeline


def _run(pipeline, requests, **policy):
    """-> outputs, [(phase, request ids) of every loop step as scheduled], the loops."""
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(**policy)))
    steps, loops = [], {}

    def phase(plan: SchedulerPlan) -> None:  # a step's phase is its head's, as it is planned
        if isinstance(plan.work, StepWork):
            head = engine._requests[plan.work.request_ids[0]].loop
            steps.append(("prefill" if head.prefilling else "decode", plan.work.request_ids))

    record_plans(engine, on_plan=phase)
    for r in requests:
        engine.add_request(r)
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            loops.update({rid: er.loop for rid, er in engine._requests.items() if er.loop is not None})
    outs = {r.request_id: engine.pop_output(r.request_id) for r in requests}
    return outs, steps, loops


def _requests(n=3, max_tokens=24):
    return [text_request(PROMPTS[i % len(PROMPTS)] * 2, max_tokens=max_tokens).model_copy(update={"request_id": f"r{i}"})
            for i in range(n)]


@pytest.fixture(scope="module")
def solo(qwen2_dir):
    pipeline = _pipeline(qwen2_dir)
    return {r.request_id: _run(pipeline, [r])[0][r.request_id].text.token_ids for r in _requests()}


def test_chunked_prefill_interleaves_with_decode_and_keeps_the_tokens(qwen2_dir, solo):
    pipeline = _pipeline(qwen2_dir, prefill_chunk_tokens=4)
    outs, steps, loops = _run(pipeline, _requests())
    assert all(o.status is RequestStatus.COMPLETED for o in outs.values())
    assert {rid: o.text.token_ids for rid, o in outs.items()} == solo
    assert max(len(lp.prompt_ids) for lp in loops.values()) > 12  # several 4-token chunks
    prefills = [i for i, (phase, _) in enumerate(steps) if phase == "prefill"]
    assert len(prefills) >= 4
    # between two prefill chunks of the long prompt, the others' decode step ran (batched)
    gaps = [steps[i + 1] for i in prefills if i + 1 < len(steps) and i + 1 not in prefills]
    assert any(phase == "decode" and len(ids) > 1 for phase, ids in gaps)
    assert all(lp.steps_done == lp.steps_target for lp in loops.values())  # one progress accounting


def test_preemption_frees_blocks_and_the_requests_resume_with_the_same_tokens(qwen2_dir, solo):
    pipeline = _pipeline(qwen2_dir, blocks=5)
    pool = pipeline.components["text_kv"]
    outs, _, loops = _run(pipeline, _requests())
    assert all(o.status is RequestStatus.COMPLETED for o in outs.values())
    assert sum(lp.preemptions for lp in loops.values()) >= 1  # three requests of ~3 blocks in 5 blocks
    assert {rid: o.text.token_ids for rid, o in outs.items()} == solo
    assert pool.free_blocks == pool.num_blocks  # every block back


def test_a_pool_too_small_for_one_request_is_refused_at_submission(qwen2_dir):
    pipeline = _pipeline(qwen2_dir, blocks=1)
    engine = Engine(pipeline)
    with pytest.raises(RequestRejected, match="needs 2 KV blocks but the text KV pool holds 1.*sampling.max_tokens"):
        engine.add_request(text_request(PROMPTS[0], max_tokens=20))


def test_cuda_graphs_route_the_batched_decode_and_keep_the_solo_tokens(qwen2_dir, solo, monkeypatch):
    """``cuda_graphs=True`` gives Qwen2's decode loop the deployment's runner (refused off CUDA at
    load); on a CPU runner (its eager route: GRAPH_DEVICES widened) every decode step of three
    batched requests takes the bucketed graph path and the tokens equal each request's solo run.
    The capture and replay: tests/pipeline/test_ar_graphs_gpu.py."""
    from omniloop.models.layers.cuda_graphs import CACHE_NAME, CudaGraphRunner
    from omniloop.pipeline.loops import ar_graphs

    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device.*cuda_graphs=False"):
        load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32, cuda_graphs=True))
    monkeypatch.setattr(ar_graphs, "GRAPH_DEVICES", frozenset({"cpu"}))
    pipeline = _pipeline(qwen2_dir)
    runner = CudaGraphRunner()
    decode = next(n for n in pipeline.spec.nodes if n.name == "decode")
    monkeypatch.setattr(decode.stage, "graphs", runner)
    pipeline.caches[CACHE_NAME] = runner
    outs, steps, _ = _run(pipeline, _requests())
    assert {rid: o.text.token_ids for rid, o in outs.items()} == solo
    batched = sum(1 for phase, ids in steps if phase == "decode" and len(ids) > 1)
    # the batched steps went through the runner (the last one samples the final tokens and forwards nothing)
    assert batched >= 10 and runner.stats.eager_not_cuda >= batched - 1
