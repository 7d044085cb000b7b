"""ARDecodeLoop: continuous batching, seeded sampling, stop conditions, streaming."""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.loops.ar import ARLoopState
from omniloop.pipeline.loops.ar_sampling import process_logits
from omniloop.engine.offline import run_request
from omniloop.request import ArtifactEvent, OmniRequest, OutputSpec, ProgressEvent, SamplingParams, TaskType, TextPart
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import run_alone, start, text_request

SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3)


def _drive_batched(pipeline, requests, join_at=None):
    """Step every live loop in ONE step_many call per tick; request ``i`` joins at tick
    ``join_at[i]`` (continuous batching: loops enter and leave the batch). -> loops, logits."""
    join_at = join_at or [0] * len(requests)
    loops: list[ARLoopState | None] = [None] * len(requests)
    logits: list[list[torch.Tensor]] = [[] for _ in requests]
    stage = ctx = None
    tick = 0
    while tick == 0 or any(lp is None or not lp.done for lp in loops):
        for i, req in enumerate(requests):
            if loops[i] is None and join_at[i] <= tick:
                _, stage, ctx, loops[i] = start(pipeline, req)
        live = [lp for lp in loops if lp is not None and not lp.done]
        if live:
            assert len({stage.batch_key(lp) for lp in live}) == 1  # different lengths share one key
            for lp in live:
                logits[loops.index(lp)].append(lp.logits.clone())
            results = stage.step_many(ctx, live)
            assert [r.done for r in results] == [lp.done for lp in live]
        tick += 1
    return loops, logits


@torch.inference_mode()
def test_step_many_over_different_lengths_equals_each_alone(qwen2_pipeline):
    requests = [text_request(PROMPTS[0], max_tokens=16), text_request(PROMPTS[1], max_tokens=9),
                text_request(PROMPTS[3], max_tokens=14)]
    alone = [run_alone(qwen2_pipeline, r) for r in requests]
    assert len({len(lp.prompt_ids) for lp, _ in alone}) == 3
    loops, logits = _drive_batched(qwen2_pipeline, requests, join_at=[0, 0, 3])  # the third joins late
    for (ref, ref_logits), loop, got in zip(alone, loops, logits):
        assert loop.output_ids == ref.output_ids and loop.text == ref.text
        assert len(got) == len(ref_logits)
        # a padded, masked batch vs each alone: other GEMM shapes, measured <= 2.6e-6 (the tokens are equal)
        assert max((a - b).abs().max().item() for a, b in zip(got, ref_logits)) <= 5e-6


@torch.inference_mode()
def test_seeded_sampling_is_reproducible_and_independent_of_batch_partners(qwen2_pipeline):
    req = text_request(PROMPTS[2], max_tokens=16, seed=1234, **SAMPLED)
    first, second = run_alone(qwen2_pipeline, req)[0], run_alone(qwen2_pipeline, req)[0]
    assert first.output_ids == second.output_ids and first.seed == 1234
    other_seed = run_alone(qwen2_pipeline, text_request(PROMPTS[2], max_tokens=16, seed=99, **SAMPLED))[0]
    assert other_seed.output_ids != first.output_ids
    partners = [text_request(PROMPTS[0], max_tokens=5, seed=7, **SAMPLED), text_request(PROMPTS[3], max_tokens=16)]
    loops, _ = _drive_batched(qwen2_pipeline, [partners[0], req, partners[1]], join_at=[0, 2, 1])
    assert loops[1].output_ids == first.output_ids


@torch.inference_mode()
def test_a_mixed_batch_gives_every_request_its_solo_tokens_and_log_probs(qwen2_pipeline):
    """Greedy, penalized-greedy and seeded sampled rows of different prompt lengths, some recording
    log-probs, in one batch (one joins late, two end early): each request's tokens equal its solo
    run's exactly, its log-probs within the batch's forward difference (<= 2.6e-6 on the logits)."""
    outputs = OutputSpec(return_log_probs=True, top_logprobs=2)
    requests = [
        text_request(PROMPTS[0], max_tokens=12),
        text_request(PROMPTS[1], max_tokens=5, seed=3, **SAMPLED),
        OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=PROMPTS[3])], outputs=outputs,
                    sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12)),
        OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=PROMPTS[2])], outputs=outputs,
                    sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=7)),
    ]
    alone = [run_alone(qwen2_pipeline, r)[0] for r in requests]
    assert len({len(lp.prompt_ids) for lp in alone}) == 4
    loops, _ = _drive_batched(qwen2_pipeline, requests, join_at=[0, 0, 2, 0])
    for ref, loop in zip(alone, loops):
        assert loop.output_ids == ref.output_ids and loop.text == ref.text
        assert [t.token_id for t in loop.log_probs] == [t.token_id for t in ref.log_probs]
        assert [[a.token_id for a in t.top] for t in loop.log_probs] == [[a.token_id for a in t.top] for t in ref.log_probs]
        assert all(abs(a.logprob - b.logprob) <= 2e-5 for a, b in zip(loop.log_probs, ref.log_probs))
    assert [len(lp.log_probs) for lp in loops] == [0, 0, 12, 7]


def test_processed_logits_match_transformers_processors():
    from transformers.generation.logits_process import (
        LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=gen) * 3
    history = torch.tensor([[3, 5, 5, 17, 40]])
    seen = torch.zeros(64, dtype=torch.bool)
    seen[history[0]] = True
    for params in (SamplingParams(**SAMPLED), SamplingParams(temperature=0.5, top_k=3),
                   SamplingParams(top_p=0.5), SamplingParams(temperature=0.0, repetition_penalty=2.0)):
        chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(params.repetition_penalty)])
        if params.temperature > 0:
            chain += [TemperatureLogitsWarper(params.temperature)]
            if params.top_k:
                chain += [TopKLogitsWarper(params.top_k)]
            if params.top_p < 1:
                chain += [TopPLogitsWarper(params.top_p)]
        expected = chain(history, logits[None].clone())[0]
        got = process_logits(logits, params, seen)
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), params
        finite = ~torch.isinf(got)
        assert torch.equal(got[finite], expected[finite]), params  # the same ops as transformers: bit for bit


@torch.inference_mode()
def test_max_tokens_stop_token_ids_and_stop_strings(qwen2_pipeline):
    greedy, _ = run_alone(qwen2_pipeline, text_request(PROMPTS[0], max_tokens=16))
    ids, text = greedy.output_ids, greedy.text

    short, _ = run_alone(qwen2_pipeline, text_request(PROMPTS[0], max_tokens=5))
    assert short.output_ids == ids[:5] and short.finish_reason == "length" and short.steps_done == 5

    stop_id = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    cut = ids.index(stop_id)
    by_id, _ = run_alone(qwen2_pipeline, text_request(PROMPTS[0], stop_token_ids=[stop_id]))
    assert by_id.output_ids == ids[: cut + 1] and by_id.finish_reason == "stop"

    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_str, _ = run_alone(qwen2_pipeline, text_request(PROMPTS[0], stop=["never appears", stop]))
    assert by_str.text == text[: text.find(stop)] and by_str.finish_reason == "stop"
    assert by_str.output_ids == ids[: len(by_str.output_ids)] and len(by_str.output_ids) < len(ids)


@pytest.mark.parametrize("stop", [[], ["on o"]])
@torch.inference_mode()
def test_streamed_deltas_concatenate_to_the_final_text(qwen2_pipeline, stop):
    for prompt in PROMPTS:
        events = []
        out = run_request(qwen2_pipeline, text_request(prompt, max_tokens=16, stop=stop), on_event=events.append)
        assert out.status.value == "completed", out.error
        deltas = [e.artifact for e in events if isinstance(e, ArtifactEvent) and e.partial]
        assert all(e.name == "text_delta" for e in events if isinstance(e, ArtifactEvent) and e.partial)
        assert "".join(d.text for d in deltas) == out.text.text
        assert [t for d in deltas for t in d.token_ids] == out.text.token_ids
        progress = [e for e in events if isinstance(e, ProgressEvent)]
        assert [p.step for p in progress] == list(range(1, len(out.text.token_ids) + 1))
        assert progress[-1].total == progress[-1].step  # an early stop ends the progress too
        assert out.metrics.steps == len(out.text.token_ids)


@torch.inference_mode()
def test_finalize_writes_text_and_frees_the_kv(qwen2_pipeline):
    state, stage, ctx, loop = start(qwen2_pipeline, text_request(PROMPTS[1], max_tokens=3))
    lm = qwen2_pipeline.components["lm"]
    assert loop.kv.num_tokens == len(loop.prompt_ids)
    assert loop.kv.nbytes == loop.kv.capacity * lm.kv_layout.bytes_per_token(torch.float32)
    while not loop.done:
        stage.step(ctx, loop)
    assert loop.kv.num_tokens == len(loop.prompt_ids) + 2  # the last token is never forwarded
    assert not any(hasattr(m, "kv") or hasattr(m, "cache") for m in lm.modules())  # the cache is not the model's
    stage.finalize(ctx, loop, state)
    assert loop.kv.freed and loop.kv.nbytes == 0
    assert state.artifacts["text"].token_ids == loop.output_ids
    assert stage.batch_key(loop) is None


@torch.inference_mode()
def test_prompt_tokens_edge_replaces_tokenization(qwen2_pipeline):
    from omniloop.pipeline.loops.ar import PromptTokens

    ref, _ = run_alone(qwen2_pipeline, text_request(PROMPTS[1]))
    node, ctx = qwen2_pipeline.spec.node("decode"), qwen2_pipeline.contexts["decode"]
    state = qwen2_pipeline.admit(text_request("ignored"))
    state.put("prompt_tokens", PromptTokens(token_ids=list(ref.prompt_ids)), node="upstream")
    loop = node.stage.init(ctx, state)
    while not loop.done:
        node.stage.step(ctx, loop)
    assert loop.prompt_ids == ref.prompt_ids and loop.output_ids == ref.output_ids
    state.put("prompt_tokens", PromptTokens(token_ids=[]), node="upstream")
    with pytest.raises(ValueError, match="the prompt is empty"):
        node.stage.init(ctx, state)


def test_generation_config_fills_only_unset_sampling_fields(tmp_path):
    import json

    from omniloop.models.families.qwen2.spec import read_generation_defaults
    from omniloop.pipeline.defaults import effective_sampling

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 3], "temperature": 0.7, "top_k": 20, "top_p": None, "do_sample": True}))
    gen = read_generation_defaults(tmp_path, {"eos_token_id": 3})
    assert gen.eos_token_ids == (3, 7) and gen.sampling == {"temperature": 0.7, "top_k": 20}
    params = effective_sampling(SamplingParams(top_k=5), gen.sampling)
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 5, 1.0)  # explicit top_k wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert read_generation_defaults(tmp_path, {}).sampling == {"temperature": 0.0}  # transformers: greedy
