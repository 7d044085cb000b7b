"""Qwen3-Omni vs transformers (``Qwen3OmniMoeForConditionalGeneration``) on a tiny random
checkpoint it saved (2-layer MoE thinker and talker with 4 experts, top-2; a 4-codebook code
predictor; a 2-layer code2wav): each part's forward, the thinker's greedy text through the
engine, the talker's greedy frames (code predictor included) and the waveform, for two voices.

Measured on the CPU in fp32: the thinker's logits within 1.2e-6 (transformers runs its experts
with ``grouped_mm``, we loop over the hit experts), the talker's and code predictor's hidden
states within 2.4e-7, code2wav bit-equal (whole and chunked); token ids, frames and the
waveform of a whole answer are equal (the waveform's max abs error 0; asserted <= 1e-6), and so
are seeded-sampled frames."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.models.families.qwen3_omni.code2wav import chunked_decode
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.qwen3_omni.checkpoint import CODEBOOK, GROUPS, PROMPTS
from tests.models.qwen3_omni.helpers import TEXT_TOKENS, chat_ids, hf_generate, omni3_request

TOL = 1e-6

@torch.inference_mode()
def test_each_part_equals_transformers(omni3_hf, omni3_pipeline):
    hf, _ = omni3_hf
    c = omni3_pipeline.components
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["thinker"].config.vocab_size, (2, 9), generator=g)
    assert (c["thinker"](ids) - hf.thinker(input_ids=ids).logits).abs().max() <= 2e-6
    x = torch.randn(1, 7, 32, generator=g)
    talker = c["talker"]
    assert (talker.model(x, torch.arange(7)[None], None) - hf.talker.model(inputs_embeds=x).last_hidden_state
            ).abs().max() <= TOL
    x = torch.randn(2, 3, 32, generator=g)
    assert (talker.code_predictor.model(x, torch.arange(3).expand(2, 3), None)
            - hf.talker.code_predictor.model(inputs_embeds=x).last_hidden_state).abs().max() <= TOL
    codes = torch.randint(0, CODEBOOK, (1, GROUPS, 37), generator=g)
    assert torch.equal(c["code2wav"](codes), hf.code2wav(codes))
    assert torch.equal(chunked_decode(c["code2wav"], codes, 10, 3), hf.code2wav.chunked_decode(codes, 10, 3))

@torch.inference_mode()
def test_greedy_text_equals_generate(omni3_hf, omni3_pipeline):
    hf, tokenizer = omni3_hf
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        expected = hf.thinker.generate(ids, max_new_tokens=TEXT_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        out = run_request(omni3_pipeline, omni3_request(prompt, speech=False))
        assert out.status.value == "completed", out.error
        assert out.text.token_ids == expected, prompt
        assert out.audio is None  # text only: the talker never ran
    raw = run_request(omni3_pipeline, omni3_request(PROMPTS[0], speech=False, chat=False))  # a raw completion prompt
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    assert raw.text.token_ids == hf.thinker.generate(ids, max_new_tokens=TEXT_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()

@pytest.mark.parametrize("voice", [None, "Chelsie"])
@torch.inference_mode()
def test_greedy_frames_and_waveform_equal_generate(omni3_hf, omni3_pipeline, voice):
    hf, tokenizer = omni3_hf
    for prompt in PROMPTS[1:] if voice is None else PROMPTS[:1]:
        capture: dict = {}
        text, wav = hf_generate(hf, tokenizer, prompt, speaker=voice or "Ethan", capture=capture)

        state = run_nodes(omni3_pipeline, omni3_request(prompt, voice=voice))
        assert state.artifacts["text"].token_ids == text
        codec = state.artifacts["codec"]
        assert codec.voice == (voice or "Ethan").lower()
        assert codec.frames == capture["codes"], prompt
        audio = state.artifacts["audio"]
        assert audio.sample_rate == 24000 and audio.samples.shape == (1, wav.shape[0])
        assert (audio.samples[0] - wav).abs().max() <= TOL
        assert wav.abs().max() > 0


@torch.inference_mode()
def test_seeded_talker_and_code_predictor_sampling_equals_generate(omni3_hf, omni3_pipeline):
    """transformers samples the talker (top-k 50, T 0.9, repetition penalty 1.05) and, inside each
    step, the code predictor (top-k 50, top-p 0.8) from the global generator seeded before
    generate; ours both from the request's seed, in the same order (a frame's residual codes, then
    the next codebook-0 code): the same frames. (The thinker is greedy in both: its generation config.)"""
    hf, tokenizer = omni3_hf
    for seed in (1, 2):
        capture: dict = {}
        hf_generate(hf, tokenizer, PROMPTS[1], seed=seed, greedy=False, capture=capture)
        state = run_nodes(omni3_pipeline, omni3_request(PROMPTS[1], seed=seed, greedy=False))
        assert state.artifacts["codec"].frames == capture["codes"], seed
