"""Spoken chat: ``/v1/chat/completions`` with ``modalities: ["text", "audio"]`` on a live server
serving a tiny Qwen2.5-Omni, driven by the official openai client: ``message.audio`` in
OpenAI's shape (base64 WAV that PyAV decodes, the transcript, an id), equal to the engine's
answer; streamed transcript and audio deltas; a bad voice or format is a 400 naming the field."""

from __future__ import annotations

import base64
import io

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

MESSAGES = [{"role": "user", "content": "say hello to the user"}]


@pytest.fixture(scope="module")
def omni_chat_dir(tmp_path_factory):
    from tests.models.qwen2_5_omni.checkpoint import save_omni_checkpoint

    folder = tmp_path_factory.mktemp("omni_chat")
    save_omni_checkpoint(folder, seed=3)
    return folder


MAX_IMAGE_PIXELS = 2**16  # the server's cap on an image's / a video frame's pixels (the wire's header check)


@pytest.fixture(scope="module")
def omni_server(omni_chat_dir):
    with live_server(omni_chat_dir, serve={"warmup": [], "max_image_pixels": MAX_IMAGE_PIXELS}) as server:
        yield server


def _engine_answer(folder, voice: str):
    _, pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    parts = [TextPart(text=m["content"], role=m["role"]) for m in MESSAGES]
    request = OmniRequest(task=TaskType.REASON, inputs=parts, sampling=SamplingParams(temperature=0.0, max_tokens=8, seed=7),
                          outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO], voice=voice))
    return run_request(pipeline, request)


def test_spoken_answer_in_openais_shape_equals_the_engine(omni_server, omni_chat_dir):
    client = omni_server.client()
    done = client.chat.completions.create(model=omni_server.state.model.name, messages=MESSAGES, temperature=0,
                                          max_tokens=8, seed=7, modalities=["text", "audio"],
                                          audio={"voice": "Ethan", "format": "wav"})
    message = done.choices[0].message
    assert message.content is None and message.audio is not None
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > 0
    want = _engine_answer(omni_chat_dir, "Ethan")
    assert message.audio.transcript == want.text.text
    samples, rate = read_audio(base64.b64decode(message.audio.data))  # a real WAV, decoded by PyAV
    assert rate == 24000 and samples.shape == tuple(want.audio.samples.shape)
    # one seed (the wire's) seeds the talker and token2wav's noise: the engine's answer exactly
    assert np.abs(samples - want.audio.samples.numpy()).max() <= 1 / 32767 + 1e-6
    assert done.choices[0].finish_reason in ("stop", "length")
    # pcm16: raw little-endian 16-bit mono, the same samples
    raw = client.chat.completions.create(model=omni_server.state.model.name, messages=MESSAGES, temperature=0,
                                         max_tokens=8, seed=7, modalities=["text", "audio"],
                                         audio={"voice": "Ethan", "format": "pcm16"})
    pcm = np.frombuffer(base64.b64decode(raw.choices[0].message.audio.data), dtype="<i2")
    assert np.array_equal(pcm, (samples[0] * 32767).round().astype("<i2"))


def test_streamed_spoken_answer(omni_server):
    client = omni_server.client()
    chunks = list(client.chat.completions.create(model=omni_server.state.model.name, messages=MESSAGES,
                                                 temperature=0, max_tokens=8, seed=7, stream=True,
                                                 modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    audio = [d.audio for d in deltas if d.audio is not None]  # openai's ChoiceDeltaAudio
    transcript = "".join(a.transcript or "" for a in audio)
    data = [a for a in audio if a.data]
    assert transcript and len(data) == 1 and data[0].id.startswith("audio_") and data[0].expires_at > 0
    assert all(d.content is None for d in deltas[1:])  # spoken: the text streams as the transcript
    samples, rate = read_audio(base64.b64decode(data[0].data))
    assert rate == 24000 and samples.shape[1] > 0
    done = client.chat.completions.create(model=omni_server.state.model.name, messages=MESSAGES, temperature=0,
                                          max_tokens=8, seed=7, modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": "wav"})
    assert transcript == done.choices[0].message.audio.transcript


def test_bad_speech_requests_are_400s_naming_the_field(omni_server):
    client = omni_server.client()
    model = omni_server.state.model.name
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, modalities=["text", "audio"],
                                       audio={"voice": "Nobody", "format": "wav"})
    body = err.value.body
    assert body["param"] == "audio.voice" and "audio.voice" in body["message"]
    assert "Chelsie" in body["message"] and "Ethan" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, modalities=["text", "audio"],
                                       audio={"voice": "Ethan", "format": "opus"})
    assert "audio.format" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, modalities=["text", "audio"])
    assert err.value.body["param"] == "audio"


def test_max_audio_tokens_bounds_the_speech_and_ends_with_length(omni_chat_dir):
    """``omniloop serve --max-audio-tokens 3`` (DeployConfig.max_audio_tokens): the talker stops
    after 3 codes (3 * repeats mel frames, BigVGAN's hop samples each) and the answer says why."""
    from omniloop.deploy import DeployConfig

    assert "max_audio_tokens" in DeployConfig.model_fields  # the CLI's --max-audio-tokens (schema flags)
    with live_server(omni_chat_dir, serve={"warmup": []}, max_audio_tokens=3) as server:
        client = server.client()
        done = client.chat.completions.create(model=server.state.model.name, messages=MESSAGES, temperature=0,
                                              max_tokens=8, seed=7, modalities=["text", "audio"],
                                              audio={"voice": "Ethan", "format": "pcm16"})
        assert done.choices[0].finish_reason == "length"
        pcm = np.frombuffer(base64.b64decode(done.choices[0].message.audio.data), dtype="<i2")
        spoken = client.chat.completions.create(model=server.state.model.name, messages=MESSAGES, temperature=0,
                                                max_tokens=8, seed=7, modalities=["text", "audio"],
                                                audio={"voice": "Ethan", "format": "pcm16"}, stream=True)
        finishes = [c.choices[0].finish_reason for c in spoken if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    repeats, hop = _token2wav_sizes(omni_chat_dir)
    assert pcm.shape[0] == 3 * repeats * hop  # 3 codes -> repeats mel frames each -> hop samples a frame
    with pytest.raises(ValueError, match="max_audio_tokens"):
        DeployConfig(max_audio_tokens=0)


def _token2wav_sizes(folder) -> tuple[int, int]:
    """(mel frames per code, samples per mel frame) from the checkpoint's config.json."""
    import json
    import math

    config = json.loads((folder / "config.json").read_text())["token2wav_config"]
    return int(config["dit_config"]["repeats"]), math.prod(config["bigvgan_config"]["upsample_rates"])


def test_streamed_pcm16_speech_starts_before_the_text_is_finished(omni_server):
    """``stream: true`` with ``audio.format: "pcm16"`` (OpenAI's streaming audio format): the
    speech arrives in ``delta.audio.data`` chunks (base64 pcm16, one per decoded window) while the
    transcript still streams: the first audio delta comes before the last transcript delta."""
    client = omni_server.client()
    chunks = list(client.chat.completions.create(model=omni_server.state.model.name, messages=MESSAGES,
                                                 temperature=0, max_tokens=32, seed=7, stream=True,
                                                 modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["data" if d.audio is not None and d.audio.data else "transcript" if d.audio is not None and d.audio.transcript
             else "" for d in deltas]
    assert kinds.count("data") >= 2
    last_transcript = max(i for i, k in enumerate(kinds) if k == "transcript")
    assert kinds.index("data") < last_transcript  # speech before the text answer is finished
    ids = {d.audio.id for d in deltas if d.audio is not None}
    assert len(ids) == 1 and ids.pop().startswith("audio_")
    pcm = np.concatenate([np.frombuffer(base64.b64decode(d.audio.data), dtype="<i2")
                          for d in deltas if d.audio is not None and d.audio.data])
    assert pcm.size > 0 and np.abs(pcm).max() > 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1


def test_a_client_leaving_a_streamed_spoken_answer_frees_every_node(omni_server):
    """The client closes the stream at its first audio delta: the request is cancelled and
    the thinker's and the talker's KV blocks all come back (every node's state freed)."""
    import json
    import time

    import httpx

    pipeline = omni_server.engine.engine.pipeline
    pools = {name: pipeline.components[name] for name in ("thinker_kv", "talker_kv")}
    free = {name: pool.free_blocks for name, pool in pools.items()}
    before = omni_server.engine.stats()["cancelled"]
    body = {"model": omni_server.state.model.name, "messages": MESSAGES, "temperature": 0, "max_tokens": 32,
            "seed": 7, "stream": True, "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"}}
    with httpx.stream("POST", f"{omni_server.url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if (delta.get("audio") or {}).get("data"):
                    break  # leave mid-answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (omni_server.engine.stats()["running"]
                                           or omni_server.engine.stats()["cancelled"] == before):
        time.sleep(0.05)
    stats = omni_server.engine.stats()
    assert stats["running"] == 0 and stats["cancelled"] == before + 1
    assert {name: pool.free_blocks for name, pool in pools.items()} == free


# -- input audio -----------------------------------------------------------------------------


def _audio_content(data: bytes, fmt: str = "wav", text: str = "what is it") -> list[dict]:
    return [{"type": "text", "text": text},
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}]


def test_input_audio_answer_equals_transformers(omni_server, omni_chat_dir):
    """An ``input_audio`` WAV through the openai client: the greedy answer's tokens are
    transformers' thinker ``generate`` on the same samples (the processor's features and
    placeholders); the prompt counts the audio's placeholders."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from tests.models.qwen2_5_omni.test_audio_input import CLIPS, hf_inputs

    client, model = omni_server.client(), omni_server.state.model.name
    done = client.chat.completions.create(model=model, temperature=0, max_tokens=8, logprobs=True,
                                          messages=[{"role": "user", "content": _audio_content(CLIPS[0])}])
    tokenizer = AutoTokenizer.from_pretrained(omni_chat_dir)
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_chat_dir, dtype=torch.float32).eval()
    inputs = hf_inputs(omni_chat_dir, tokenizer, "what is it", CLIPS[:1])
    with torch.inference_mode():
        want = hf.thinker.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert [t.token for t in done.choices[0].logprobs.content] == [tokenizer.decode([i]) for i in want]
    assert done.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert done.usage.prompt_tokens == inputs["input_ids"].shape[1]


def test_input_audio_mp3_is_resampled(omni_server, tmp_path):
    """A 44.1 kHz stereo mp3 is decoded and resampled to 16 kHz mono: 0.5 s -> 50 mel frames'
    worth of placeholders (12), give or take the codec's padding frames."""
    from omniloop.io.audio import encode_audio

    t = np.arange(22050) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)]).astype(np.float32) * 0.5
    client, model = omni_server.client(), omni_server.state.model.name
    text_only = client.chat.completions.create(model=model, temperature=0, max_tokens=2,
                                               messages=[{"role": "user", "content": "what is it"}])
    done = client.chat.completions.create(model=model, temperature=0, max_tokens=2, messages=[
        {"role": "user", "content": _audio_content(encode_audio(stereo, 44100, "mp3"), "mp3")}])
    added = done.usage.prompt_tokens - text_only.usage.prompt_tokens - 3  # <|audio_bos|> <|AUDIO|>*n <|audio_eos|>, less one
    assert 12 <= added + 1 <= 14, added


@pytest.mark.parametrize("data, says", [
    (b"RIFF\x00\x00\x00\x00WAVE not really", "wav or mp3"),
    (None, "at most 2 s"),
])
def test_bad_input_audio_is_a_400_naming_the_part(omni_server, data, says):
    from tests.models.qwen2_5_omni.test_audio_input import tone, wav_bytes

    data = data if data is not None else wav_bytes(tone(16000 * 3))
    client, model = omni_server.client(), omni_server.state.model.name
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": _audio_content(data)}])
    body = err.value.body
    assert body["param"] == "messages[0].content[1].input_audio.data", body
    assert says in body["message"], body
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content is not None  # the engine keeps serving


def test_image_url_answer_equals_transformers(omni_server, omni_chat_dir):
    """An ``image_url`` data URL through the openai client reaches the vision encoder: the greedy
    answer's tokens are transformers' thinker ``generate`` on the processor's patches."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from tests.models.qwen2_5_omni.test_vision_encoder import _hf_image_inputs, _png

    png = _png(96, 64, 0)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    client, model = omni_server.client(), omni_server.state.model.name
    done = client.chat.completions.create(model=model, temperature=0, max_tokens=8, logprobs=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]}])
    tokenizer = AutoTokenizer.from_pretrained(omni_chat_dir)
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_chat_dir, dtype=torch.float32).eval()
    inputs = _hf_image_inputs(omni_chat_dir, tokenizer, "what is it", [png])
    with torch.inference_mode():
        want = hf.thinker.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert [t.token for t in done.choices[0].logprobs.content] == [tokenizer.decode([i]) for i in want]
    assert done.usage.prompt_tokens == inputs["input_ids"].shape[1]


# -- images and videos, with spoken answers ----------------------------------------------------


def _video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def test_spoken_answers_to_an_image_and_a_video_equal_the_engine(omni_server, omni_chat_dir):
    """``image_url`` and ``video_url`` parts with ``modalities: ["text", "audio"]`` through the
    openai client: the transcript, the prompt's placeholders and the speech are the engine's on
    the same conversation (the engine's equality with transformers' generate:
    tests/models/qwen2_5_omni/test_spoken_media.py, test_video_input.py)."""
    from omniloop.request import ImagePart, VideoPart
    from tests.models.qwen2_5_omni.test_video_input import CLIP
    from tests.models.qwen2_5_omni.test_vision_encoder import _png

    _, pipeline = load_pipeline(omni_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    client, model = omni_server.client(), omni_server.state.model.name
    image_url = "data:image/png;base64," + base64.b64encode(_png(112, 112, 0)).decode()
    for kind, url, part, placeholders in (("image", image_url, ImagePart(b64=image_url, role="reference"), 16),
                                          ("video", _video_url(CLIP), VideoPart(b64=_video_url(CLIP)), 280)):
        content = [{"type": "text", "text": "what is it"}, {"type": f"{kind}_url", f"{kind}_url": {"url": url}}]
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], temperature=0,
                                              max_tokens=8, seed=7, modalities=["text", "audio"],
                                              audio={"voice": "Chelsie", "format": "wav"})
        request = OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"), part],
                              sampling=SamplingParams(temperature=0.0, max_tokens=8, seed=7),
                              outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO], voice="Chelsie"))
        want = run_request(pipeline, request)
        assert done.choices[0].message.audio.transcript == want.text.text, kind
        assert done.usage.prompt_tokens == want.text.prompt_tokens > placeholders, kind  # the placeholders expanded
        samples, rate = read_audio(base64.b64decode(done.choices[0].message.audio.data))
        assert rate == 24000 and samples.shape == tuple(want.audio.samples.shape), kind
        assert np.abs(samples - want.audio.samples.numpy()).max() <= 1 / 32767 + 1e-6, kind
    # the video's answer streamed (pcm16: token2wav window by window behind the talker, on the same positions)
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                 temperature=0, max_tokens=8, seed=7, stream=True,
                                                 modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"}))
    deltas = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio is not None]
    assert "".join(d.transcript or "" for d in deltas) == want.text.text
    pcm = np.concatenate([np.frombuffer(base64.b64decode(d.data), dtype="<i2") for d in deltas if d.data])
    assert pcm.size == want.audio.samples.shape[1]  # the same codes: as many samples as the whole decode


def _clip(frames: int, fps: int, size: tuple[int, int] = (16, 16)) -> bytes:
    from omniloop.io.video import encode_mp4

    return encode_mp4(np.zeros((frames, *size, 3), dtype=np.uint8), fps)


@pytest.mark.parametrize("clip, says", [
    (b"\x00\x00\x00\x18ftypmp42 not a video", "cannot decode this video"),
    ((400, 1), "the video is 400.0 s long, over the 384 s this model reads"),
    ((2, 4, (256, 320)), f"over this server's {MAX_IMAGE_PIXELS:,} (max_image_pixels)"),
])
def test_bad_video_url_is_a_400_naming_the_part(omni_server, clip, says):
    """An undecodable, too long or too large video: a 400 whose param is the part's path and whose
    message names the limit; the engine keeps serving."""
    data = clip if isinstance(clip, bytes) else _clip(*clip)
    client, model = omni_server.client(), omni_server.state.model.name
    content = [{"type": "text", "text": "what happens"}, {"type": "video_url", "video_url": {"url": _video_url(data)}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": content}])
    body = err.value.body
    assert body["param"] == "messages[0].content[1].video_url.url", body
    assert says in body["message"], body
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content is not None  # the engine keeps serving


def test_a_video_heard_with_its_soundtrack_equals_the_engine(omni_server, omni_chat_dir):
    """vLLM's ``mm_processor_kwargs: {"use_audio_in_video": true}`` (openai's ``extra_body``): the
    soundtrack's placeholders join the frames' (the engine's answer with
    ``node_params["chat"].use_audio_in_video``; equal to transformers:
    tests/models/qwen2_5_omni/test_video_input.py). A video without a soundtrack is a 400 naming
    the part; a wrong key in mm_processor_kwargs names itself."""
    from omniloop.io.video import encode_mp4
    from omniloop.request import VideoPart
    from tests.models.qwen2_5_omni.test_video_input import CLIP, FRAMES

    t = np.arange(16000) / 16000
    clip = encode_mp4(FRAMES, 4, audio=(np.sin(2 * np.pi * 440 * t) * 0.3)[None].astype(np.float32), sample_rate=16000)
    client, model = omni_server.client(), omni_server.state.model.name
    content = [{"type": "text", "text": "what is it"}, {"type": "video_url", "video_url": {"url": _video_url(clip)}}]
    heard = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], temperature=0,
                                          max_tokens=6, seed=7, extra_body=heard)
    seen = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], temperature=0,
                                          max_tokens=6, seed=7)
    _, pipeline = load_pipeline(omni_chat_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    want = run_request(pipeline, OmniRequest(
        task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"), VideoPart(b64=_video_url(clip))],
        sampling=SamplingParams(temperature=0.0, max_tokens=6, seed=7), node_params={"chat": {"use_audio_in_video": True}}))
    assert done.choices[0].message.content == want.text.text
    assert done.usage.prompt_tokens == want.text.prompt_tokens
    # 1 s of sound: 25 placeholders (26 with AAC's padding frames), and <|audio_bos|> <|audio_eos|>
    assert 25 + 2 <= done.usage.prompt_tokens - seen.usage.prompt_tokens <= 26 + 2
    mute = [{"type": "text", "text": "what is it"}, {"type": "video_url", "video_url": {"url": _video_url(CLIP)}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": mute}], max_tokens=2,
                                       extra_body=heard)
    assert err.value.body["param"] == "messages[0].content[1].video_url.url", err.value.body
    assert "soundtrack" in err.value.body["message"] and "use_audio_in_video" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={"mm_processor_kwargs": {"fps": 2}})
    assert err.value.body["param"].startswith("mm_processor_kwargs"), err.value.body
