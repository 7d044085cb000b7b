"""A spoken answer to a conversation with an image, vs transformers' ``generate`` (the audio
prompt's twin is ``test_audio_input.test_spoken_answer_given_audio_equals_transformers``).

transformers' talker reads the thinker's embeddings and hidden states of the whole prompt, with
zeros at the image's positions, and derives its rotary positions with ``get_rope_index`` over
the conversation's ids (then the voice's start token and the first reply token) and the image's
grid: the thinker's 3-D positions and delta. Ours carries those positions from the thinker's
first chunk to the talker (``TalkerRow.rope``).

Oracle notes: transformers 5.25's ``generate`` hands every unprefixed keyword to the talker too,
and the talker's ``generate`` refuses ``pixel_values`` as unused; ``talker_pixel_values=None``
keeps it from the talker only (the thinker still reads it). A one-token masked left pad keeps
transformers' talker on the path the checkpoint was trained on (``helpers.hf_generate``).

Measured on the CPU in fp32: the codes are identical and the waveform bit-equal (max abs 0);
the assert allows ``WAVE_TOL``."""

from __future__ import annotations

import base64

import torch

from omniloop.request import DiffusionParams, ImagePart, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.qwen2_5_omni.checkpoint import CODEC_EOS, CODEC_PAD
from tests.models.qwen2_5_omni.helpers import AUDIO_TOKENS, TEXT_TOKENS, run_nodes
from tests.models.qwen2_5_omni.test_vision_encoder import _hf_image_inputs, _png

WAVE_TOL = 1e-6  # measured 0.0


def spoken_request(parts: list, *, seed: int = 5) -> OmniRequest:
    return OmniRequest(task=TaskType.REASON, inputs=parts,
                       sampling=SamplingParams(temperature=0.0, seed=seed, max_tokens=TEXT_TOKENS),
                       diffusion=DiffusionParams(seed=seed), outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO]),
                       node_params={"talker": {"max_tokens": AUDIO_TOKENS}})


def left_padded(inputs: dict, pad_id: int) -> dict:
    """``inputs`` with one masked pad token in front (see the module's oracle notes)."""
    ids = torch.cat([torch.tensor([[pad_id]]), inputs["input_ids"]], dim=1)
    mask = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.ones_like(inputs["input_ids"])], dim=1)
    return {**inputs, "input_ids": ids, "attention_mask": mask}


def hf_spoken(hf, inputs: dict, **extra) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' greedy spoken answer -> (text ids, talker codes, waveform)."""
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
                               talker_eos_token_id=[CODEC_PAD, CODEC_EOS], **extra)
    finally:
        del hf.token2wav.forward
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), captured["codes"], wav


@torch.inference_mode()
def test_spoken_answer_given_an_image_equals_transformers(omni_hf, omni_pipeline, omni_dir, monkeypatch):
    import omniloop.models.families.qwen2_5_omni.stages as stages

    hf, tokenizer = omni_hf
    png = _png(112, 112, 0)  # 8x8 patches -> 16 image positions spanning 4 on the h / w planes
    inputs = left_padded(_hf_image_inputs(omni_dir, tokenizer, "what is it", [png]), tokenizer.pad_token_id)
    text, codes, wav = hf_spoken(hf, inputs, talker_pixel_values=None)
    request = spoken_request([TextPart(text="what is it", role="user"),
                              ImagePart(b64=base64.b64encode(png).decode(), role="reference")])
    state = run_nodes(omni_pipeline, request)
    assert state.artifacts["text"].token_ids == text
    assert state.artifacts["codec"].codes == codes and len(codes) == AUDIO_TOKENS
    audio = state.artifacts["audio"].samples[0]
    assert audio.shape == wav.shape and (audio - wav).abs().max() <= WAVE_TOL
    # the talker's 3-D positions are what made them equal: on 1-D positions its codes differ
    prompt = stages.talker_prompt

    def flat(*args):
        row = prompt(*args)
        row.rope = None
        return row

    monkeypatch.setattr(stages, "talker_prompt", flat)
    assert run_nodes(omni_pipeline, request).artifacts["codec"].codes != codes
