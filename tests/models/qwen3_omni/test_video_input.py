"""Video in a Qwen3-Omni conversation vs transformers on the tiny checkpoint.

The clip is a real mp4 (PyAV H.264, 5 frames of 40x60 at 4 fps: 1.25 s) decoded by our reader and
sampled at 2 fps (qwen-omni-utils' rule, at least 4 frames: 0, 1, 3, 4; two temporal patches).
``Qwen3OmniMoeProcessor`` (its ``Qwen2VLVideoProcessor``, torchvision, in a child process:
``tests/models/qwen2_5_omni/video_oracle.py --qwen3``) turns those frames into the oracle's ids
and patches as the released usage calls it (no fps: the processor's default 1, so
``video_second_per_grid`` 2); each frame is resized up to its 128 * 32 * 32 pixels (320x448), 140
placeholders a temporal patch. Against transformers' thinker given the processor's inputs: the
patches bit-equal, the 3-D positions equal ``get_rope_index``'s, the prompt's logits within 1e-5
(measured on the CPU in fp32: 1.9e-6, 4.0e-6 with the soundtrack), the greedy text identical; with
the soundtrack (``use_audio_in_video``) the same, the processor's time-merged layout token for
token. A spoken answer to the video: its 11 frames equal and the waveform bit-equal (max abs 0).
A spoken answer to a video read with its soundtrack is refused: transformers 5.25's talker fails
on that prompt (no reference)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from omniloop.io.video import encode_mp4
from omniloop.models.omni.thinker import ThinkerRow
from omniloop.request import InvalidRequest, Modality, OutputSpec
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.qwen2_5_omni.test_video_input import (
    BAD_VIDEOS, check_bad_video_refused, check_oversized_frames_refused, run_oracle, video_part, video_request,
)
from tests.models.qwen3_omni.helpers import AUDIO_FRAMES, TEXT_TOKENS, hf_generate_from

LOGIT_TOL = 1e-5
KEYS = ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
AUDIO_KEYS = ("input_features", "feature_attention_mask")


def soundtracked_clip() -> bytes:
    """A 3 s clip (12 frames at 4 fps -> 6 sampled, three temporal patches) with a 1.25 s AAC soundtrack."""
    t = np.arange(20000) / 16000
    sound = (np.sin(2 * np.pi * 440 * t) * 0.3 + np.random.default_rng(1).standard_normal(t.shape) * 0.05)
    frames = np.random.default_rng(2).integers(0, 256, (12, 40, 60, 3), dtype=np.uint8)
    return encode_mp4(frames, 4, audio=sound[None].astype(np.float32), sample_rate=16000)


def with_soundtrack(request):
    return request.model_copy(update={"node_params": {**request.node_params, "chat": {"use_audio_in_video": True}}})


@pytest.fixture(scope="module")
def oracle(omni3_dir, omni3_pipeline, tmp_path_factory):
    """The processor's ids, patches, grid and seconds per grid for the sampled frames."""
    from omniloop.models.omni.video_prompt import decode_frames

    frames = decode_frames(1, video_part(), omni3_pipeline.components["video_processing"])
    assert frames.shape == (4, 40, 60, 3)
    return run_oracle(omni3_dir, frames, tmp_path_factory.mktemp("omni3_video_oracle"), qwen3=True)


@pytest.fixture(scope="module")
def sound_oracle(omni3_dir, omni3_pipeline, tmp_path_factory):
    from omniloop.models.omni.video_prompt import decode_frames, soundtrack

    part = video_part(soundtracked_clip())
    sampled = decode_frames(1, part, omni3_pipeline.components["video_processing"])
    heard = soundtrack(1, part, omni3_pipeline.components["feature_extractor"]).samples
    assert sampled.shape[0] == 6
    return run_oracle(omni3_dir, sampled, tmp_path_factory.mktemp("omni3_sound_oracle"), heard, qwen3=True)


def test_video_patches_equal_the_processors(omni3_pipeline, oracle):
    from omniloop.models.omni.video_prompt import process_video

    video = process_video(1, video_part(), omni3_pipeline.components["video_processing"])
    assert video.grid == tuple(oracle["video_grid_thw"][0].tolist()) == (2, 20, 28)
    assert video.seconds_per_grid == float(oracle["video_second_per_grid"][0]) == 2.0
    assert torch.equal(video.pixels, oracle["pixel_values_videos"])


def _check_prompt(hf, pipeline, request, inputs: dict, soundtrack: bool) -> None:
    """Our chat node's ids, 3-D positions and the thinker's prompt logits vs transformers'."""
    state = run_nodes(pipeline, request)
    prompt = state.artifacts["prompt_tokens"]
    assert prompt.token_ids == inputs["input_ids"][0].tolist()  # the processor's layout, token for token
    positions, delta = hf.thinker.get_rope_index(
        inputs["input_ids"], video_grid_thw=inputs["video_grid_thw"], attention_mask=inputs["attention_mask"],
        use_audio_in_video=soundtrack, second_per_grids=inputs["video_second_per_grid"],
        audio_seqlens=inputs["feature_attention_mask"].sum(-1) if soundtrack else None)
    assert torch.equal(prompt.lm_inputs.positions, positions[:, 0].long()) and positions.frac().abs().max() == 0
    assert prompt.lm_inputs.delta == int(delta)
    ours = pipeline.components["thinker"](inputs["input_ids"],
                                          lm_inputs=[ThinkerRow(media=prompt.lm_inputs, record_states=False)])
    theirs = hf.thinker(**inputs, use_audio_in_video=soundtrack).logits
    assert (ours - theirs).abs().max() <= LOGIT_TOL
    want = hf.thinker.generate(**inputs, use_audio_in_video=soundtrack, max_new_tokens=TEXT_TOKENS, do_sample=False)
    assert state.artifacts["text"].token_ids == want[0, inputs["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def test_a_video_prompt_equals_transformers(omni3_hf, omni3_pipeline, oracle):
    """Our whole path from the mp4 bytes (decode, sample, preprocess, expand, ViT + DeepStack at the
    video's cells, 3-D positions spaced by 2 s a temporal patch) vs the processor's inputs through
    transformers' thinker."""
    hf, _ = omni3_hf
    _check_prompt(hf, omni3_pipeline, video_request(), {k: oracle[k] for k in KEYS}, soundtrack=False)


@torch.inference_mode()
def test_a_video_with_its_soundtrack_equals_transformers(omni3_hf, omni3_pipeline, sound_oracle):
    """``node_params["chat"].use_audio_in_video``: the soundtrack's 17 tokens after the first
    temporal patch's cells (times 0 and 26, 52: 13 positions a second x 2 s a patch), then the
    other two patches, between ``<|audio_start|>`` / ``<|audio_end|>`` numbered as text."""
    hf, tokenizer = omni3_hf
    inputs = {k: sound_oracle[k] for k in KEYS + AUDIO_KEYS}
    ids = inputs["input_ids"][0].tolist()
    audio, video = tokenizer.convert_tokens_to_ids("<|AUDIO|>"), tokenizer.convert_tokens_to_ids("<|VIDEO|>")
    assert ids.index(audio) < len(ids) - 1 - ids[::-1].index(video)  # interleaved: cells after the soundtrack's
    request = with_soundtrack(video_request(video_part(soundtracked_clip())))
    _check_prompt(hf, omni3_pipeline, request, inputs, soundtrack=True)


@torch.inference_mode()
def test_a_spoken_answer_to_a_video_equals_generate(omni3_hf, omni3_pipeline, oracle):
    """The talker reads ``hidden_projection`` of the thinker's states at the video's positions and
    lays out its own prompt's 3-D positions from the video's grid and seconds per grid."""
    hf, tokenizer = omni3_hf
    capture: dict = {}
    text, wav = hf_generate_from(hf, tokenizer, {k: oracle[k] for k in KEYS}, capture=capture, seed=None)
    request = video_request().model_copy(update={"outputs": OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO]),
                                                 "node_params": {"talker": {"max_tokens": AUDIO_FRAMES}}})
    state = run_nodes(omni3_pipeline, request)
    assert state.artifacts["text"].token_ids == text
    assert state.artifacts["codec"].frames == capture["codes"]
    assert (state.artifacts["audio"].samples[0] - wav).abs().max() <= 1e-6


@pytest.mark.parametrize("clip, says", BAD_VIDEOS)
def test_bad_video_is_refused_naming_the_part(omni3_pipeline, clip, says):
    """Undecodable, too long (refused from the header: nothing decodes), too few frames: the limits
    Qwen2.5-Omni's videos have."""
    check_bad_video_refused(omni3_pipeline, clip, says)


def test_a_silent_video_read_with_its_soundtrack_is_refused(omni3_pipeline):
    with pytest.raises(InvalidRequest, match=r"^inputs\[1\]: its soundtrack cannot be read") as caught:
        omni3_pipeline.admit(with_soundtrack(video_request()))
    assert caught.value.fields == ("inputs[1]",)


def test_a_spoken_answer_to_a_video_with_its_soundtrack_is_refused(omni3_pipeline):
    """transformers 5.25's talker fails on that prompt (its get_rope_index reads the talker config's
    missing audio_config): no reference, so it is refused at admission, naming the part."""
    request = with_soundtrack(video_request(video_part(soundtracked_clip()))).model_copy(
        update={"outputs": OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO])})
    with pytest.raises(InvalidRequest, match=r"^inputs\[1\]: a spoken answer to a video read with its soundtrack") as caught:
        omni3_pipeline.admit(request)
    assert caught.value.fields == ("inputs[1]",)


def test_a_frame_over_the_pixel_limit_is_refused_before_decoding(omni3_pipeline):
    check_oversized_frames_refused(omni3_pipeline)


@pytest.mark.parametrize("grid, frames, layout", [((3, 4, 6), 500, "vavava"), ((4, 2, 2), 260, "vavav"), ((2, 4, 4), 40, "vav")])
def test_soundtrack_layout_and_positions_equal_transformers(omni3_hf, grid, frames, layout):
    """Longer soundtracks than the tiny extractor's 2 s window: ``VisionRun.interleaved`` (by time)
    vs ``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` itself, and ``rope_positions`` vs
    the thinker's ``get_rope_index`` on those ids (``frames`` feature frames: 65 / 34 / 5 tokens,
    so soundtrack tokens also come after the later frame groups: ``layout``, the runs of video /
    audio placeholders)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor, _get_feat_extract_output_lengths,
    )

    from omniloop.models.omni.image_prompt import VisionRun, rope_positions, video_ids

    hf, tokenizer = omni3_hf
    tokens = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    names = SimpleNamespace(audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>", video_token="<|VIDEO|>",
                            audio_token="<|AUDIO|>", video_processor=SimpleNamespace(merge_size=2))
    text = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        names, {"video_grid_thw": torch.tensor([grid]), "video_second_per_grid": [2.0]}, 0,
        {"num_audio_tokens": torch.tensor([tokens])}, 0, position_id_per_seconds=13)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|audio_start|>", "<|audio_end|>", "<|VIDEO|>", "<|AUDIO|>",
                                                           "<|vision_start|>", "<|vision_end|>")}
    run = VisionRun(ids["<|VIDEO|>"], grid, 2.0, tokens, by_time=True)
    body = video_ids(run, 2, 13, video_token=ids["<|VIDEO|>"], audio_token=ids["<|AUDIO|>"],
                     audio_start=ids["<|audio_start|>"], audio_end=ids["<|audio_end|>"])
    assert body == tokenizer.convert_tokens_to_ids(re.findall(r"<\|[a-zA-Z_]+\|>", text))
    assert "".join(kind[0] for kind, _, _ in run.interleaved(2, 13)) == layout
    prompt = tokenizer("the cat").input_ids + [ids["<|vision_start|>"], *body, ids["<|vision_end|>"]] + tokenizer("hello").input_ids
    ours, delta = rope_positions(prompt, [run], 2, 13)
    theirs, their_delta = hf.thinker.get_rope_index(torch.tensor([prompt]), video_grid_thw=torch.tensor([grid]),
                                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                                    use_audio_in_video=True, audio_seqlens=torch.tensor([frames]),
                                                    second_per_grids=torch.tensor([2.0]))
    assert torch.equal(ours, theirs[:, 0].long()) and delta == int(their_delta)
