"""The Qwen2.5-Omni graph through the engine (the offline API): a spoken answer is text plus
24 kHz audio that writes as a WAV PyAV decodes; requests batch their thinker / talker /
token2wav steps and each equals its solo run; bad input is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.offline import run_request
from omniloop.io.audio import read_audio, write_audio
from omniloop.request import ActionPart, ImagePart, OmniRequest, SamplingParams, TaskType, TextPart
from tests.models.qwen2_5_omni.checkpoint import PROMPTS
from tests.models.qwen2_5_omni.helpers import omni_request


@pytest.fixture(scope="module")
def omni_generator(omni_dir):
    return VideoGenerator.from_pretrained(omni_dir, device="cpu", dtype="float32")


def test_a_spoken_answer_is_text_and_a_wav(omni_generator, omni_pipeline, tmp_path):
    out = omni_generator.generate(omni_request(PROMPTS[0]))
    assert out.status.value == "completed", out.error
    assert out.text is not None and out.text.token_ids and out.text.finish_reason in ("stop", "length")
    audio = out.audio
    assert audio is not None and audio.sample_rate == 24000 and audio.node == "vocoder"
    assert audio.samples.shape[0] == 1 and audio.samples.shape[1] > 0 and audio.samples.abs().max() > 0
    # same request, same seed: the same answer (node-by-node run through the pipeline object)
    again = run_request(omni_pipeline, omni_request(PROMPTS[0]))
    assert torch.equal(again.audio.samples, audio.samples) and again.text.token_ids == out.text.token_ids
    path = tmp_path / "answer.wav"
    write_audio(audio.samples, path, audio.sample_rate)
    decoded, rate = read_audio(path)  # PyAV
    assert rate == 24000 and decoded.shape == tuple(audio.samples.shape)
    assert np.abs(decoded - audio.samples.numpy()).max() <= 1 / 32767 + 1e-6  # 16-bit PCM


@torch.inference_mode()
def test_concurrent_spoken_answers_batch_and_equal_solo(omni_generator, omni_pipeline):
    solo = [run_request(omni_pipeline, omni_request(p, seed=i)) for i, p in enumerate(PROMPTS)]
    engine = omni_generator.engine
    ids = [engine.add_request(omni_request(p, seed=i)) for i, p in enumerate(PROMPTS)]
    for rid in ids:
        engine.run_until_done(rid)
    outs = [engine.pop_output(rid) for rid in ids]
    for alone, together in zip(solo, outs):
        assert together.status.value == "completed", together.error
        assert together.text.token_ids == alone.text.token_ids
        # batched decode steps pad and mask the KV (measured: 0.0 on the CPU; a bound for other kernels)
        assert together.audio.samples.shape == alone.audio.samples.shape
        assert (together.audio.samples - alone.audio.samples).abs().max() <= 1e-6


@torch.inference_mode()
def test_spoken_answers_to_images_and_videos_batch_with_text_and_equal_solo(omni_generator, omni_pipeline):
    """A spoken answer to an image (3-D talker positions), one to a video and one to text run at
    once: their thinker and talker steps batch (rows with and without 3-D positions in one
    forward), and each equals its solo run."""
    import base64

    from tests.models.qwen2_5_omni.test_spoken_media import spoken_request
    from tests.models.qwen2_5_omni.test_video_input import video_part
    from tests.models.qwen2_5_omni.test_vision_encoder import _png

    image = ImagePart(b64=base64.b64encode(_png(112, 112, 0)).decode(), role="reference")
    requests = [spoken_request([TextPart(text="what is it", role="user"), image]),
                spoken_request([TextPart(text="what happens", role="user"), video_part()], seed=6),
                omni_request(PROMPTS[0])]
    solo = [run_request(omni_pipeline, r) for r in requests]
    engine = omni_generator.engine
    ids = [engine.add_request(r) for r in requests]
    for rid in ids:
        engine.run_until_done(rid)
    for alone, rid in zip(solo, ids):
        together = engine.pop_output(rid)
        assert together.status.value == "completed", together.error
        assert together.text.token_ids == alone.text.token_ids
        assert together.audio.samples.shape == alone.audio.samples.shape
        assert (together.audio.samples - alone.audio.samples).abs().max() <= 1e-6  # measured 0.0


def test_a_text_only_request_runs_only_the_thinker(omni_pipeline):
    out = run_request(omni_pipeline, omni_request(PROMPTS[1], speech=False))
    assert out.status.value == "completed" and out.text.token_ids and out.audio is None


def test_bad_input_is_refused_naming_the_field(omni_pipeline):
    with pytest.raises(ValueError, match=r"voice 'Nobody' is not one of .*\['Chelsie', 'Ethan'\]") as err:
        run_request(omni_pipeline, omni_request(PROMPTS[0], voice="Nobody"))
    assert err.value.fields == ("outputs.voice",)
    image = ImagePart(b64="bm90IGFuIGltYWdl")  # "not an image"
    with pytest.raises(ValueError, match=r"inputs\[1\]: cannot decode the image") as err:
        run_request(omni_pipeline, OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="hi", role="user"), image],
                                               sampling=SamplingParams(max_tokens=4)))
    assert err.value.fields == ("inputs[1]",)
    action = ActionPart(values=[[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"inputs carry \['action'\] parts; Qwen2.5-Omni reads text, audio, images "
                                         r"and videos") as err:
        run_request(omni_pipeline, OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="hi", role="user"), action]))
    assert err.value.fields == ("inputs",)
    with pytest.raises(ValueError, match=r"node_params\['talker'\]\.max_tokens"):
        run_request(omni_pipeline, omni_request(PROMPTS[0]).model_copy(update={"node_params": {"talker": {"max_tokens": 0}}}))
