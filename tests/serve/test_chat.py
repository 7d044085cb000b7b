"""``/v1/chat/completions`` on live servers, driven by the official openai client unmodified:
a Qwen2 LM (chat template) and Cosmos3 (its reasoner on the resident transformer); SSE
streaming, the sampling fields, bad input as 400s naming the field. Cosmos3 on the Videos
API: an mp4 with an AAC soundtrack (both streams decoded by PyAV), predicted actions as JSON."""

from __future__ import annotations

import base64
import io

import av
import httpx
import numpy as np
import pytest
import torch

from omniloop.engine import Engine
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world, the quick brown fox"}]


@pytest.fixture(scope="module")
def lm_server(qwen2_chat_dir):
    with live_server(qwen2_chat_dir, serve={"warmup": []}) as server:
        yield server


def _engine_tokens(folder, messages, **sampling):
    _, pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    engine = Engine(pipeline)
    parts = [TextPart(text=m["content"], role=m["role"]) for m in messages]
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, inputs=parts, sampling=SamplingParams(**sampling)))
    with torch.inference_mode():
        out = engine.run_until_done(rid)
    return out.text


def test_completion_equals_the_engine_and_streaming_equals_the_completion(lm_server, qwen2_chat_dir):
    client = lm_server.client()
    done = client.chat.completions.create(messages=MESSAGES, model=lm_server.state.model.name, temperature=0,
                                          max_tokens=9)
    want = _engine_tokens(qwen2_chat_dir, MESSAGES, temperature=0.0, max_tokens=9)
    choice = done.choices[0]
    assert done.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
    assert done.usage.completion_tokens == len(want.token_ids) and done.usage.prompt_tokens == want.prompt_tokens
    stream = client.chat.completions.create(messages=MESSAGES, model=lm_server.state.model.name, temperature=0,
                                            max_tokens=9, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and len([c for c in chunks if c.choices]) >= 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_sampling_fields(lm_server, qwen2_chat_dir):
    client, model = lm_server.client(), lm_server.state.model.name
    kw = dict(messages=MESSAGES, model=model, max_tokens=12, temperature=0.9, top_p=0.8)
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    assert a == client.chat.completions.create(seed=11, **kw).choices[0].message.content  # seeded: reproducible
    want = _engine_tokens(qwen2_chat_dir, MESSAGES, max_tokens=12, temperature=0.9, top_p=0.8, seed=11)
    assert a == want.text
    greedy = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=12, temperature=0).choices[0]
    stop = greedy.message.content[2:4]
    cut = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    assert greedy.message.content.startswith(cut.choices[0].message.content)


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 100000}, "max_tokens"), ({"model": "gpt-4o"}, "model"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFF....WAVE").decode(), "format": "wav"}}]}]},  # a text LM has no audio encoder
     "messages[0].content[1].input_audio"),
])
def test_bad_input_is_a_400_naming_the_field(lm_server, extra, param):
    body = {"model": lm_server.state.model.name, "messages": MESSAGES, **extra}
    r = httpx.post(f"{lm_server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()


def _data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


@pytest.mark.parametrize("kind, url, says", [
    ("video", _data_url("video/mp4", b"\x00\x00\x00 ftypisom not really an mp4"), "cannot decode this video"),
    ("video", "http://127.0.0.1:9/clip.mp4", "remote and file URLs are not fetched"),
    ("image", _data_url("image/png", b"\x89PNG truncated"), "cannot decode this image"),
])
def test_undecodable_media_urls_are_400s_naming_the_part(lm_server, kind, url, says):
    """Through the openai client: the 400's param is the content part's JSON path and the
    message says what to pass (a data: URL of a format the server decodes); the same helper
    refuses image_url and video_url parts; the server keeps serving."""
    import openai

    client, model = lm_server.client(), lm_server.state.model.name
    content = [{"type": "text", "text": "what happens"}, {"type": f"{kind}_url", f"{kind}_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(messages=[{"role": "user", "content": content}], model=model, max_tokens=2)
    error = caught.value.body
    assert error["param"] == f"messages[0].content[1].{kind}_url.url", error
    assert says in error["message"] and "as a data: URL" in error["message"], error
    assert ("mp4" if kind == "video" else "PNG") in error["message"]
    ok = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content is not None


def test_a_text_model_without_a_chat_template_refuses_conversations(qwen2_dir):
    with live_server(qwen2_dir, serve={"warmup": []}) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


# -- Cosmos3 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cosmos3_dir(tmp_path_factory):
    from tests.models.cosmos3.checkpoint import save_pipeline

    folder = tmp_path_factory.mktemp("cosmos3_serve")
    save_pipeline(folder)
    return folder


@pytest.fixture(scope="module")
def cosmos3_server(cosmos3_dir):
    # max_pixels admits an action run's canvas (a first frame at tier 256 runs at 320x192), which
    # the ceiling counts since it is checked on the resolved request
    with live_server(cosmos3_dir, serve={"warmup": []}, limits={"max_steps": 4, "max_frames": 17,
                                                                "max_pixels": 320 * 192}) as server:
        yield server


def _decode(data: bytes):
    with av.open(io.BytesIO(data)) as c:
        video = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]
    with av.open(io.BytesIO(data)) as c:
        audio_stream = c.streams.audio[0]
        codec, rate = audio_stream.codec_context.name, audio_stream.rate
        audio = np.concatenate([f.to_ndarray() for f in c.decode(audio_stream)], axis=-1)
    return np.stack(video), codec, rate, audio


def test_cosmos3_chat_and_a_video_with_its_soundtrack(cosmos3_server, cosmos3_dir):
    client, model = cosmos3_server.client(), cosmos3_server.state.model.name
    messages = [{"role": "user", "content": "a robot arm picks up a cube"}]
    done = client.chat.completions.create(messages=messages, model=model, temperature=0, max_tokens=8)
    assert done.choices[0].message.content == _engine_tokens(cosmos3_dir, messages, temperature=0.0, max_tokens=8).text

    video = client.videos.create(prompt="a red circle moving right", size="64x64",
                                 extra_body={"audio": True, "num_frames": 9, "steps": 2, "seed": 1})
    assert cosmos3_server.wait_finished(video.id)["status"] == "completed"
    data = httpx.get(f"{cosmos3_server.url}/v1/videos/{video.id}/content").content
    frames, codec, rate, audio = _decode(data)
    assert frames.shape == (9, 64, 64, 3) and codec == "aac" and rate == 8000 and audio.shape[0] == 2


def test_cosmos3_predicted_actions_come_back_as_json(cosmos3_server):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((64, 96, 3), 90, dtype=np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"prompt": "pick up the cube", "input_reference": {"image_url": url}, "predict_actions": True,
            "num_frames": 5, "steps": 2, "seed": 1,
            "node_params": {"denoise": {"domain": "bridge_orig_lerobot", "resolution_tier": 256}}}
    r = httpx.post(f"{cosmos3_server.url}/v1/videos", json=body, timeout=30)
    assert r.status_code == 200, r.text
    done = cosmos3_server.wait_finished(r.json()["id"])
    assert done["status"] == "completed", done
    assert np.asarray(done["actions"]).shape == (4, 10)  # 4 steps of the embodiment's 10-wide actions
    bad = httpx.post(f"{cosmos3_server.url}/v1/videos", json={**body, "node_params": {"denoise": {"domain": "x"}}})
    assert bad.status_code == 400 and "not a known embodiment domain" in bad.json()["error"]["message"]


def test_cosmos3_chat_with_an_image_and_a_video(cosmos3_dir, tmp_path_factory):
    """Image and video content parts (data: URLs) reach the reasoner's ViT through the openai
    client: each answer equals the engine's on the same media; the image's differs from a
    text-only question's."""
    from PIL import Image

    from omniloop.request import ImagePart
    from tests.models.cosmos3.checkpoint import save_unified

    unified = save_unified(cosmos3_dir, tmp_path_factory.mktemp("cosmos3_unified_vit"), vision=True)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it"}]
    _, pipeline = load_pipeline(unified, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    engine = Engine(pipeline)
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, sampling=SamplingParams(max_tokens=8, temperature=0.0),
                                         inputs=[ImagePart(data=pixels, role="reference"), TextPart(text="what is it", role="user")]))
    with torch.inference_mode():
        want = engine.run_until_done(rid).text
    from omniloop.io.video import write_mp4
    from omniloop.request import VideoPart

    mp4 = io.BytesIO()  # 8 frames at 24 fps: the processor samples 4, two temporal patch groups
    write_mp4(np.random.default_rng(1).integers(0, 256, (8, 32, 48, 3), dtype=np.uint8), mp4, 24)
    clip_url = "data:video/mp4;base64," + base64.b64encode(mp4.getvalue()).decode()
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, sampling=SamplingParams(max_tokens=8, temperature=0.0),
                                         inputs=[VideoPart(b64=clip_url), TextPart(text="what is it", role="user")]))
    with torch.inference_mode():
        watched_want = engine.run_until_done(rid).text
    with live_server(unified, serve={"warmup": []}) as server:
        client = server.client()
        kw = dict(model=server.state.model.name, temperature=0, max_tokens=8)
        seen = client.chat.completions.create(messages=[{"role": "user", "content": content}], **kw)
        blind = client.chat.completions.create(messages=[{"role": "user", "content": "what is it"}], **kw)
        video = [{"type": "video_url", "video_url": {"url": clip_url}}, {"type": "text", "text": "what is it"}]
        watched = client.chat.completions.create(messages=[{"role": "user", "content": video}], **kw)
    assert seen.choices[0].message.content == want.text
    assert seen.usage.prompt_tokens == want.prompt_tokens > blind.usage.prompt_tokens  # the image's tokens
    assert seen.choices[0].message.content != blind.choices[0].message.content
    assert watched.choices[0].message.content == watched_want.text
    assert watched.usage.prompt_tokens == watched_want.prompt_tokens > blind.usage.prompt_tokens
