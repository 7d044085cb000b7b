"""Audio in a Qwen2.5-Omni conversation vs transformers on the tiny checkpoint (saved with its
``WhisperFeatureExtractor``): the audio encoder's output, the thinker's greedy text and the
spoken answer (talker codes, waveform) given audio, and the admission refusals.

The oracle's prompt is built as ``Qwen2_5OmniProcessor`` builds it (its ``_process_audio``:
the feature extractor padded to its window with the frame mask, each ``<|AUDIO|>`` repeated
``_get_feat_extract_output_lengths`` times; the processor object itself needs torchvision's
video processor, which the test environment lacks). The audio is a real 16 kHz WAV file whose
samples the oracle reads with the standard library (int16 / 32768). Measured on the CPU in
fp32: everything is bit-equal (torch.equal)."""

from __future__ import annotations

import base64
import re

import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.models.families.qwen2_5_omni.audio_encoder import audio_tokens
from omniloop.request import (AudioPart, DiffusionParams, ImagePart, InvalidRequest, Modality, OmniRequest, OutputSpec,
                              SamplingParams, TaskType, TextPart)
from tests.models.qwen2_5_omni.checkpoint import AUDIO_WINDOW_S, CODEC_EOS, CODEC_PAD
from tests.models.omni_helpers import (  # noqa: F401  (RATE, tone, wav_bytes: the serving tests' clips)
    RATE, audio_tower_input, hf_audio_inputs, tone, wav_bytes,
)
from tests.models.qwen2_5_omni.helpers import AUDIO_TOKENS, TEXT_TOKENS, run_nodes

def audio_request(text: str, clips: list[bytes], *, speech: bool = False, **sampling) -> OmniRequest:
    parts = [TextPart(text=text, role="user"), *[AudioPart(b64=base64.b64encode(c).decode()) for c in clips]]
    sampling.setdefault("max_tokens", TEXT_TOKENS)
    return OmniRequest(task=TaskType.REASON, inputs=parts, sampling=SamplingParams(temperature=0.0, seed=5, **sampling),
                       diffusion=DiffusionParams(seed=5),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO] if speech else None),
                       node_params={"talker": {"max_tokens": AUDIO_TOKENS}} if speech else {})


def hf_inputs(folder, tokenizer, text: str, clips: list[bytes], pad: bool = False) -> dict:
    """The processor's inputs for ``[text, audio...]`` in one user message (``pad``: see
    helpers.hf_generate: a masked left pad keeps transformers' talker on the trained path)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    return hf_audio_inputs(folder, tokenizer, text, clips, _get_feat_extract_output_lengths, pad=pad)


CLIPS = [wav_bytes(tone(12000, 0)), wav_bytes(tone(3000, 1))]  # 0.75 s (2 chunks of the tiny encoder), 0.19 s


@torch.inference_mode()
def test_audio_encoder_equals_transformers(omni_hf, omni_pipeline, omni_dir):
    hf, tokenizer = omni_hf
    inputs = hf_inputs(omni_dir, tokenizer, "x", CLIPS)
    want = hf.thinker.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]).last_hidden_state
    flat, lengths = audio_tower_input(inputs)
    got = omni_pipeline.components["audio_tower"](flat, lengths)
    assert got.shape == (sum(audio_tokens(n) for n in lengths), 32)
    assert torch.equal(got, want)


@torch.inference_mode()
def test_greedy_text_given_audio_equals_transformers(omni_hf, omni_pipeline, omni_dir):
    hf, tokenizer = omni_hf
    for clips in (CLIPS[:1], CLIPS):
        inputs = hf_inputs(omni_dir, tokenizer, "what is it", clips)
        seq = hf.thinker.generate(**inputs, max_new_tokens=TEXT_TOKENS, do_sample=False)
        out = run_request(omni_pipeline, audio_request("what is it", clips))
        assert out.status.value == "completed", out.error
        assert out.text.prompt_tokens == inputs["input_ids"].shape[1]  # the placeholders expanded as the processor does
        assert out.text.token_ids == seq[0, inputs["input_ids"].shape[1]:].tolist()
    other = run_request(omni_pipeline, audio_request("what is it", [CLIPS[1], CLIPS[0]]))
    assert other.text.token_ids != out.text.token_ids  # the audio is read, not ignored: its order matters


@torch.inference_mode()
def test_spoken_answer_given_audio_equals_transformers(omni_hf, omni_pipeline, omni_dir):
    """The talker's prompt reads zeros where the thinker read audio embeddings (transformers'
    generate masks them): the same codes and waveform."""
    hf, tokenizer = omni_hf
    inputs = hf_inputs(omni_dir, tokenizer, "what is it", CLIPS[:1], pad=True)
    captured: dict = {}
    forward = hf.token2wav.forward

    def spy(code, conditioning, reference_mel, **kw):
        captured["codes"] = code[0].tolist()
        return forward(code, conditioning, reference_mel, **kw)

    hf.token2wav.forward = spy
    try:
        torch.manual_seed(5)
        seq, wav = hf.generate(**inputs, speaker="Chelsie", thinker_max_new_tokens=TEXT_TOKENS, thinker_do_sample=False,
                               talker_do_sample=False, talker_max_new_tokens=AUDIO_TOKENS,
                               talker_eos_token_id=[CODEC_PAD, CODEC_EOS])
    finally:
        del hf.token2wav.forward
    state = run_nodes(omni_pipeline, audio_request("what is it", CLIPS[:1], speech=True))
    assert state.artifacts["text"].token_ids == seq[0, inputs["input_ids"].shape[1]:].tolist()
    assert state.artifacts["codec"].codes == captured["codes"]
    assert torch.equal(state.artifacts["audio"].samples[0], wav)


def test_bad_audio_is_refused_naming_the_part(omni_pipeline):
    b64 = base64.b64encode(CLIPS[0]).decode()
    long = wav_bytes(tone(RATE * AUDIO_WINDOW_S + 1600))
    cases = [
        (audio_request("x", [b"RIFF not a wav at all"]), "inputs[1]", "wav or mp3"),
        (audio_request("x", [long]), "inputs[1]", f"at most {AUDIO_WINDOW_S} s"),
        (audio_request("x", [wav_bytes(tone(200))]), "inputs[1]", "too short"),
        (OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="x"), AudioPart(b64=b64)],
                     sampling=SamplingParams(max_tokens=4)), "inputs[1]", "conversation"),
        (OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="x", role="user"), ImagePart(b64=b64)],
                     sampling=SamplingParams(max_tokens=4)), "inputs[1]", "cannot decode the image"),
    ]
    for request, field, says in cases:
        with pytest.raises(InvalidRequest, match=re.escape(says)) as caught:
            omni_pipeline.admit(request)
        assert caught.value.fields == (field,), str(caught.value)


def test_merge_by_position_is_the_same_in_chunks():
    """A chunked prefill swaps in the same embeddings as one forward: rows are addressed by
    position, so any split of the prompt (and a re-prefill after preemption) sees one input."""
    from omniloop.models.omni.media import MediaEmbeds

    g = torch.Generator().manual_seed(0)
    index = torch.tensor([-1, -1, 0, 1, 2, -1, 3, 4, -1])
    media = MediaEmbeds(index=index, embeds=torch.randn(5, 4, generator=g))
    h = torch.randn(12, 4, generator=g)  # 9 prompt positions + 3 generated
    whole = media.merge(h, 0)
    assert torch.equal(whole[:9][index >= 0], media.embeds) and torch.equal(whole[9:], h[9:])
    for cut in (1, 3, 4, 7, 9):
        assert torch.equal(torch.cat([media.merge(h[:cut], 0), media.merge(h[cut:], cut)]), whole)
    assert media.mask(2, 11).tolist() == [True, True, True, False, True, True, False, False, False]


@torch.inference_mode()
def test_audio_requests_batch_with_others_and_equal_solo(omni_dir, omni_pipeline):
    """Through the engine: two audio conversations and a text prompt at once (their thinker
    steps batch) each give their solo answer."""
    from omniloop.api.generator import VideoGenerator
    from tests.models.qwen2_5_omni.helpers import omni_request

    requests = [audio_request("what is it", CLIPS[:1]), audio_request("and this", CLIPS[::-1]),
                omni_request("the cat", speech=False)]
    solo = [run_request(omni_pipeline, r) for r in requests]
    engine = VideoGenerator.from_pretrained(omni_dir, device="cpu", dtype="float32").engine
    ids = [engine.add_request(r) for r in requests]
    for rid in ids:
        engine.run_until_done(rid)
    for alone, rid in zip(solo, ids):
        together = engine.pop_output(rid)
        assert together.status.value == "completed", together.error
        assert together.text.token_ids == alone.text.token_ids


def test_an_audio_part_goes_into_its_roles_message():
    """The released model's usage opens with a system prompt, then the user's audio and question:
    the audio is the user's (its ``role``), not appended to the system message before it."""
    from omniloop.pipeline.stages.chat import chat_messages

    b64 = base64.b64encode(CLIPS[0]).decode()
    request = OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="be brief", role="system"),
                                                        AudioPart(b64=b64, role="user"),
                                                        TextPart(text="what is it", role="user")])
    assert chat_messages(request) == [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "audio"},
                                                                   {"type": "text", "text": "what is it"}]}]


def test_a_checkpoint_without_an_encoder_part_refuses_its_media_naming_the_first_missing_part():
    from omniloop.models.omni.video_prompt import require
    from omniloop.request import InvalidRequest

    require("inputs[1]", "audio", "Qwen2.5-Omni", ("thinker.audio_tower.* weights", object()), ("its extractor", object()))
    with pytest.raises(InvalidRequest, match=r"^inputs\[1\]: this checkpoint has no its extractor, so it takes no "
                                             r"audio") as refused:
        require("inputs[1]", "audio", "Qwen2.5-Omni", ("thinker.audio_tower.* weights", object()), ("its extractor", None))
    assert refused.value.fields == ("inputs[1]",)
    with pytest.raises(InvalidRequest, match="has no thinker.visual.\\* weights, so it takes no images"):
        require("inputs[0]", "images", "Qwen2.5-Omni", ("thinker.visual.* weights", None), ("image processor", None))
