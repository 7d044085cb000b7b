"""Qwen2.5-Omni vs transformers (``Qwen2_5OmniForConditionalGeneration``) on a tiny random
checkpoint it saved: every part's forward, the thinker's greedy text and hidden states, the
talker's codes (greedy, and seeded sampling) and the waveform, for two voices.

Measured on the CPU in fp32: every comparison is bit-equal (max abs error 0); the asserts
allow 1e-6 on the waveform and the part forwards (a bound, in case of another machine's
kernels), and exact equality on token ids and codes."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.models.families.qwen2_5_omni.model import TalkerRow
from omniloop.models.families.qwen2_5_omni.stages import CodecCodes, ThinkerStates
from tests.models.qwen2_5_omni.checkpoint import CODEC_BOS, CODEC_MASK, PROMPTS
from tests.models.qwen2_5_omni.helpers import TEXT_TOKENS, hf_generate, omni_request, run_nodes

WAVE_TOL = 1e-6  # measured 0.0


@torch.inference_mode()
def test_each_part_equals_transformers(omni_hf, omni_pipeline):
    hf, _ = omni_hf
    c = omni_pipeline.components
    g = torch.Generator().manual_seed(0)
    # thinker: text logits
    ids = torch.randint(0, c["thinker"].config.vocab_size, (2, 9), generator=g)
    assert (c["thinker"](ids) - hf.thinker(input_ids=ids).logits).abs().max() <= 1e-6
    # talker: codec logits from prepared embeddings (a plain forward: positions 0..L-1)
    embeds = torch.randn(1, 7, 32, generator=g)
    ours = c["talker"](torch.full((1, 7), CODEC_MASK), lm_inputs=[TalkerRow(prompt_embeds=embeds[0], reply=embeds[0, :1])])
    theirs = hf.talker(inputs_embeds=embeds.clone()).logits
    keep = [i for i in range(theirs.shape[-1]) if i != CODEC_BOS]  # ours suppresses the codec start (generate does)
    assert (ours[..., keep] - theirs[..., keep]).abs().max() <= 1e-6
    assert torch.isinf(ours[..., CODEC_BOS]).all()
    # token2wav DiT: one guided velocity; BigVGAN: mel -> waveform
    dit, spk = hf.token2wav.code2wav_dit_model, hf.speaker_map["Chelsie"]
    x, codes, t = torch.randn(1, 14, 16, generator=g), torch.randint(0, 60, (1, 7), generator=g), torch.tensor(0.3)
    out = dit(hidden_states=x, quantized_code=codes, speaker_embedding=spk["cond"].unsqueeze(1).repeat(1, 14, 1),
              condition_vector=spk["ref_mel"], time_step=t, apply_cfg=True)
    guided, null = out.chunk(2)
    speaker = omni_pipeline.components["speakers"]["Chelsie"]
    ours = c["dit"](x, t[None], codes, speaker.cond, speaker.ref_mel, 0.5)
    assert (ours - (guided + (guided - null) * 0.5)).abs().max() <= 1e-6
    mel = torch.randn(1, 16, 14, generator=g) - 2
    assert (c["vocoder"](mel)[0] - hf.token2wav.code2wav_bigvgan_model(mel)).abs().max() <= 1e-6


@torch.inference_mode()
def test_greedy_text_equals_generate(omni_hf, omni_pipeline):
    hf, tokenizer = omni_hf
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = hf.generate(ids, thinker_max_new_tokens=TEXT_TOKENS, generation_mode="text")[0, ids.shape[1]:].tolist()
        out = run_request(omni_pipeline, omni_request(prompt, speech=False))
        assert out.status.value == "completed", out.error
        assert out.text.token_ids == expected, prompt
        assert out.audio is None  # text only: the talker never ran


@torch.inference_mode()
def test_thinker_states_equal_transformers_hidden_states(omni_hf, omni_pipeline):
    """What the talker reads: the final hidden state of every forwarded position."""
    hf, tokenizer = omni_hf
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    result = hf.thinker.generate(ids, max_new_tokens=TEXT_TOKENS, do_sample=False, output_hidden_states=True,
                                 return_dict_in_generate=True)
    expected = torch.cat([step[-1][0] for step in result.hidden_states])  # [P + n - 1, D]
    state = run_nodes(omni_pipeline, omni_request(PROMPTS[1]))
    states = state.artifacts["thinker_states"]
    assert isinstance(states, ThinkerStates)
    assert states.output_ids == result.sequences[0, ids.shape[1]:].tolist()
    assert states.hidden.shape == expected.shape and (states.hidden - expected).abs().max() <= 1e-6


@pytest.mark.parametrize("voice", ["Chelsie", "Ethan"])
@torch.inference_mode()
def test_greedy_codes_and_waveform_equal_generate(omni_hf, omni_pipeline, voice):
    hf, tokenizer = omni_hf
    waves = []
    for prompt in PROMPTS[:2] if voice == "Chelsie" else PROMPTS[:1]:
        capture: dict = {}
        text, wav = hf_generate(hf, tokenizer, prompt, speaker=voice, capture=capture)
        state = run_nodes(omni_pipeline, omni_request(prompt, voice=None if voice == "Chelsie" else voice))
        assert state.artifacts["text"].token_ids == text
        codec = state.artifacts["codec"]
        assert isinstance(codec, CodecCodes) and codec.voice == voice
        assert codec.codes == capture["codes"], prompt
        audio = state.artifacts["audio"]
        assert audio.sample_rate == 24000 and audio.samples.shape == (1, wav.shape[0])
        assert (audio.samples[0] - wav).abs().max() <= WAVE_TOL
        waves.append(wav)
    assert waves[0].abs().max() > 0


@torch.inference_mode()
def test_seeded_talker_sampling_equals_generate(omni_hf, omni_pipeline):
    """transformers samples the talker (top-k 40, top-p 0.8, T 0.9, repetition penalty 1.05)
    from the global generator seeded before generate; ours from the request's seed: the same
    codes. (The thinker is greedy in both: its default, as the checkpoint's generation config.)"""
    hf, tokenizer = omni_hf
    for seed in (1, 2):
        capture: dict = {}
        hf_generate(hf, tokenizer, PROMPTS[0], seed=seed, greedy=False, capture=capture)
        state = run_nodes(omni_pipeline, omni_request(PROMPTS[0], seed=seed, greedy=False))
        assert state.artifacts["codec"].codes == capture["codes"], seed
