"""Qwen3-Omni hears: audio parts of a conversation through the thinker's audio encoder (bit-equal to
transformers' ``Qwen3OmniMoeAudioEncoder``), their embeddings at the expanded placeholders, the
greedy text, and a spoken answer whose talker reads the thinker's accept-layer states at the
audio positions (``hidden_projection``): frames and waveform equal to transformers' ``generate``
given the processor's inputs (the placeholder count is transformers' own formula). Bad audio is
refused naming the part."""

from __future__ import annotations

import base64

import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.request import AudioPart, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.omni_helpers import RATE, audio_tower_input, hf_audio_inputs, tone, wav_bytes
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.qwen3_omni.checkpoint import AUDIO_WINDOW_S
from tests.models.qwen3_omni.helpers import AUDIO_FRAMES, TEXT_TOKENS, hf_generate_from

CLIPS = [wav_bytes(tone(20000, 0)), wav_bytes(tone(3000, 1))]  # 1.25 s (2 chunks of 1 s), 0.19 s


def audio_request(text: str, clips: list[bytes], *, speech: bool = False) -> OmniRequest:
    parts = [TextPart(text=text, role="user"), *[AudioPart(b64=base64.b64encode(c).decode()) for c in clips]]
    return OmniRequest(task=TaskType.REASON, inputs=parts,
                       sampling=SamplingParams(temperature=0.0, seed=5, max_tokens=TEXT_TOKENS),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO] if speech else None),
                       node_params={"talker": {"max_tokens": AUDIO_FRAMES}} if speech else {})


def hf_inputs(folder, tokenizer, text: str, clips: list[bytes]) -> dict:
    """The processor's inputs for ``[text, audio...]`` in one user message (its placeholder count:
    transformers' ``_get_feat_extract_output_lengths``)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    return hf_audio_inputs(folder, tokenizer, text, clips, _get_feat_extract_output_lengths)


@torch.inference_mode()
def test_audio_encoder_and_greedy_text_equal_transformers(omni3_hf, omni3_pipeline, omni3_dir):
    hf, tokenizer = omni3_hf
    inputs = hf_inputs(omni3_dir, tokenizer, "what is it", CLIPS)
    want = hf.thinker.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]).last_hidden_state
    flat, lengths = audio_tower_input(inputs)
    assert torch.equal(omni3_pipeline.components["audio_tower"](flat, lengths), want)
    for clips in (CLIPS[:1], CLIPS):
        inputs = hf_inputs(omni3_dir, tokenizer, "what is it", clips)
        seq = hf.thinker.generate(**inputs, max_new_tokens=TEXT_TOKENS, do_sample=False)
        out = run_request(omni3_pipeline, audio_request("what is it", clips))
        assert out.status.value == "completed", out.error
        assert out.text.prompt_tokens == inputs["input_ids"].shape[1]  # the placeholders expanded as the processor does
        assert out.text.token_ids == seq[0, inputs["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def test_spoken_answer_to_audio_equals_generate(omni3_hf, omni3_pipeline, omni3_dir):
    hf, tokenizer = omni3_hf
    inputs = hf_inputs(omni3_dir, tokenizer, "what is it", CLIPS)
    capture: dict = {}
    text, wav = hf_generate_from(hf, tokenizer, inputs, capture=capture, seed=None)
    state = run_nodes(omni3_pipeline, audio_request("what is it", CLIPS, speech=True))
    assert state.artifacts["text"].token_ids == text
    assert state.artifacts["codec"].frames == capture["codes"]
    assert (state.artifacts["audio"].samples[0] - wav).abs().max() <= 1e-6


@pytest.mark.parametrize("parts, field, match", [
    ([TextPart(text="x", role="user"), AudioPart(b64=base64.b64encode(wav_bytes(tone(RATE * AUDIO_WINDOW_S + 1600))).decode())],
     "inputs[1]", r"longer than the 2 s this model reads"),
    ([TextPart(text="x", role="user"), AudioPart(b64=base64.b64encode(b"not a wav").decode())], "inputs[1]", r"inputs\[1\]"),
    ([TextPart(text="x"), AudioPart(b64=base64.b64encode(CLIPS[1]).decode())], "inputs[1]", r"audio goes into a conversation"),
])
def test_bad_audio_is_refused_naming_the_part(omni3_pipeline, parts, field, match):
    with pytest.raises(ValueError, match=match) as err:
        run_request(omni3_pipeline, OmniRequest(task=TaskType.REASON, inputs=parts, sampling=SamplingParams(max_tokens=4)))
    assert err.value.fields == (field,)
