"""Spoken chat with Qwen3-Omni: ``/v1/chat/completions`` with ``modalities: ["text", "audio"]`` on a
live server serving a tiny Qwen3-Omni, driven by the official openai client: ``message.audio``
in OpenAI's shape (base64 WAV that PyAV decodes, the transcript), equal to the engine's answer;
``max_audio_tokens`` bounds the speech (``finish_reason: "length"``); a bad voice is a 400
naming ``audio.voice`` and the voices. (The server helpers are the Qwen2.5-Omni test's.)"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.io.audio import read_audio
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.serve.conftest import live_server
from tests.serve.test_spoken_chat import MESSAGES

MAX_AUDIO_TOKENS = 6


@pytest.fixture(scope="module")
def omni3_chat_dir(tmp_path_factory):
    from tests.models.qwen3_omni.checkpoint import save_omni3_checkpoint

    folder = tmp_path_factory.mktemp("omni3_chat")
    save_omni3_checkpoint(folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def omni3_server(omni3_chat_dir):
    with live_server(omni3_chat_dir, serve={"warmup": []}, max_audio_tokens=MAX_AUDIO_TOKENS) as server:
        yield server


def test_spoken_answer_in_openais_shape_equals_the_engine(omni3_server, omni3_chat_dir):
    client = omni3_server.client()
    done = client.chat.completions.create(model=omni3_server.state.model.name, messages=MESSAGES, temperature=0,
                                          max_tokens=8, seed=7, modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": "wav"})
    message = done.choices[0].message
    assert message.audio is not None and message.audio.id.startswith("audio_")
    _, pipeline = load_pipeline(omni3_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32,
                                                            max_audio_tokens=MAX_AUDIO_TOKENS))
    want = run_request(pipeline, OmniRequest(
        task=TaskType.REASON, inputs=[TextPart(text=m["content"], role=m["role"]) for m in MESSAGES],
        sampling=SamplingParams(temperature=0.0, max_tokens=8, seed=7),
        outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO], voice="Chelsie")))
    assert message.audio.transcript == want.text.text
    samples, rate = read_audio(base64.b64decode(message.audio.data))  # a real WAV, decoded by PyAV
    assert rate == 24000 and samples.shape == tuple(want.audio.samples.shape) and samples.shape[1] > 0
    assert np.abs(samples - want.audio.samples.numpy()).max() <= 1 / 32767 + 1e-6  # 16-bit PCM
    assert want.audio.finish_reason == "length"  # the tiny talker never says its codec end within 6 frames
    assert done.choices[0].finish_reason == "length"


def test_a_bad_voice_is_a_400_naming_the_field(omni3_server):
    client = omni3_server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=omni3_server.state.model.name, messages=MESSAGES, max_tokens=4,
                                       modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"})
    body = err.value.body
    assert body["param"] == "audio.voice" and "['chelsie', 'ethan']" in body["message"]


def test_streamed_pcm16_speech_equals_the_whole_answer(omni3_server):
    """``stream: true`` with ``audio.format: "pcm16"``: the speech arrives in ``delta.audio.data``
    chunks decoded window by window (``codec_stream`` -> ``Code2WavStream``); an answer within one
    window (6 frames here, 25 a window) is the non-streamed answer's samples exactly."""
    client = omni3_server.client()
    args = dict(model=omni3_server.state.model.name, messages=MESSAGES, temperature=0, max_tokens=8, seed=7,
                modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"})
    whole = np.frombuffer(base64.b64decode(client.chat.completions.create(**args).choices[0].message.audio.data),
                          dtype="<i2")
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    data = [d.audio.data for d in deltas if d.audio is not None and d.audio.data]
    assert data and any(d.audio is not None and d.audio.transcript for d in deltas)
    pcm = np.concatenate([np.frombuffer(base64.b64decode(x), dtype="<i2") for x in data])
    assert np.array_equal(pcm, whole) and np.abs(pcm).max() > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_input_audio_reaches_the_audio_encoder(omni3_server, omni3_chat_dir):
    """An ``input_audio`` content part (base64 WAV) is heard: the answer equals the engine's given
    the same audio part."""
    from omniloop.request import AudioPart
    from tests.models.qwen3_omni.test_audio_input import CLIPS

    b64 = base64.b64encode(CLIPS[0]).decode()
    client = omni3_server.client()
    done = client.chat.completions.create(
        model=omni3_server.state.model.name, temperature=0, max_tokens=6, seed=7,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}])
    _, pipeline = load_pipeline(omni3_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    want = run_request(pipeline, OmniRequest(
        task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"), AudioPart(b64=b64, role="user")],
        sampling=SamplingParams(temperature=0.0, max_tokens=6, seed=7)))
    assert done.choices[0].message.content == want.text.text
    assert done.usage.prompt_tokens == want.text.prompt_tokens > 20  # the audio's placeholders expanded


def test_image_url_reaches_the_vision_encoder(omni3_server, omni3_chat_dir):
    """An ``image_url`` data URL is seen: the answer equals the engine's given the same image part."""
    from omniloop.request import ImagePart
    from tests.models.qwen3_omni.test_image_input import IMAGES

    b64 = base64.b64encode(IMAGES[0]).decode()
    client = omni3_server.client()
    done = client.chat.completions.create(
        model=omni3_server.state.model.name, temperature=0, max_tokens=6, seed=7,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}]}])
    _, pipeline = load_pipeline(omni3_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    want = run_request(pipeline, OmniRequest(
        task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"), ImagePart(b64=b64)],
        sampling=SamplingParams(temperature=0.0, max_tokens=6, seed=7)))
    assert done.choices[0].message.content == want.text.text
    assert done.usage.prompt_tokens == want.text.prompt_tokens


def test_video_url_reaches_the_vision_encoder(omni3_server, omni3_chat_dir):
    """A ``video_url`` data URL is seen, and with vLLM's ``mm_processor_kwargs: {"use_audio_in_video":
    true}`` heard too: each answer equals the engine's given the same video part (the engine's
    equality with transformers: tests/models/qwen3_omni/test_video_input.py); a silent video read
    with its soundtrack is a 400 naming the part."""
    from omniloop.request import VideoPart
    from tests.models.qwen3_omni.test_video_input import soundtracked_clip

    url = "data:video/mp4;base64," + base64.b64encode(soundtracked_clip()).decode()
    client, model = omni3_server.client(), omni3_server.state.model.name
    content = [{"type": "text", "text": "what is it"}, {"type": "video_url", "video_url": {"url": url}}]
    _, pipeline = load_pipeline(omni3_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    for heard in (False, True):
        extra = {"mm_processor_kwargs": {"use_audio_in_video": True}} if heard else None
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              temperature=0, max_tokens=6, seed=7, extra_body=extra)
        want = run_request(pipeline, OmniRequest(
            task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"), VideoPart(b64=url)],
            sampling=SamplingParams(temperature=0.0, max_tokens=6, seed=7),
            node_params={"chat": {"use_audio_in_video": True}} if heard else {}))
        assert done.choices[0].message.content == want.text.text, heard
        assert done.usage.prompt_tokens == want.text.prompt_tokens > 420 + 17 * heard, heard  # 3 x 140 cells (+ soundtrack)
    from tests.models.qwen2_5_omni.test_video_input import CLIP

    silent = [content[0], {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(CLIP).decode()}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": silent}], max_tokens=4,
                                       extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    assert err.value.body["param"] == "messages[0].content[1].video_url.url" and "soundtrack" in err.value.body["message"]
