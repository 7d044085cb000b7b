"""Qwen2 vs transformers: forward logits, greedy generation, EOS, KV-cached decode."""

from __future__ import annotations

import pytest
import torch

from omniloop.cache.kv import KVBatch, KVHandle
from omniloop.models.families.qwen2.weights import load_qwen2
from omniloop.engine.offline import run_request
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import run_alone, text_request, with_defaults


@pytest.mark.parametrize("fixture", ["qwen2_dir", "qwen2_tied_dir"])
@torch.inference_mode()
def test_forward_logits_match_transformers(fixture, request):
    from transformers import Qwen2ForCausalLM

    folder = request.getfixturevalue(fixture)
    theirs = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_qwen2(folder, dtype=torch.float32)
    assert (ours.lm_head is None) == theirs.config.tie_word_embeddings
    ids = torch.randint(0, ours.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    expected = theirs(ids).logits
    assert (ours(ids) - expected).abs().max() <= 1e-5
    assert (ours(ids, logits_to_keep=1) - expected[:, -1:]).abs().max() <= 1e-5


@torch.inference_mode()
def test_greedy_generation_matches_transformers_generate(qwen2_pipeline, qwen2_hf):
    hf, tokenizer = qwen2_hf
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        out = run_request(qwen2_pipeline, text_request(prompt, max_tokens=16))
        assert out.status.value == "completed", out.error
        assert out.text.token_ids == expected, prompt
        assert out.text.text == tokenizer.decode([t for t in expected if t != tokenizer.eos_token_id],
                                                 skip_special_tokens=True)


@torch.inference_mode()
def test_eos_stops_like_transformers(qwen2_pipeline, qwen2_hf):
    """With an EOS id the greedy path hits, both stop right after emitting it."""
    hf, tokenizer = qwen2_hf
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    greedy = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = greedy[5]
    cut = greedy.index(eos)
    expected = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)[0, ids.shape[1]:].tolist()
    assert expected == greedy[: cut + 1]
    pipeline = with_defaults(qwen2_pipeline, eos_token_ids=(eos,))
    loop, _ = run_alone(pipeline, text_request(PROMPTS[0], max_tokens=16))
    assert loop.output_ids == expected and loop.finish_reason == "stop"
    assert loop.text == tokenizer.decode(expected[:-1])  # the EOS token adds no text
    assert loop.steps_target == loop.steps_done == cut + 1  # progress ends where the request did


@torch.inference_mode()
def test_kv_cached_decode_equals_recomputation(qwen2_pipeline):
    """The logits behind every decoded token equal a cache-free forward over prompt + output."""
    lm = qwen2_pipeline.components["lm"]
    loop, logits = run_alone(qwen2_pipeline, text_request(PROMPTS[1], max_tokens=12, temperature=0.8, seed=3))
    seq = loop.prompt_ids + loop.output_ids
    full = lm(torch.tensor([seq]))[0]  # [L, V]
    for i, step_logits in enumerate(logits):
        assert (step_logits - full[len(loop.prompt_ids) - 1 + i]).abs().max() <= 1e-5, i


@torch.inference_mode()
def test_chunked_prefill_through_kv_equals_one_shot(qwen2_pipeline):
    """A prompt prefilled in pieces (a cache prefix + several new tokens: bottom-right causal
    mask) gives the logits of one causal forward."""
    lm = qwen2_pipeline.components["lm"]
    ids = torch.randint(0, lm.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    handle = KVHandle(lm.kv_layout, dtype=torch.float32, device="cpu", chunk_tokens=8)
    parts = [lm(ids[:, a:b], kv=KVBatch([handle], b - a)) for a, b in ((0, 7), (7, 8), (8, 20), (20, 23))]
    assert (torch.cat(parts, dim=1) - lm(ids)).abs().max() <= 1e-5
    assert handle.num_tokens == 23 and handle.capacity == 24
