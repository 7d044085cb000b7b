"""Serving sound: /v1/videos returns video with sound when the model makes it ("audio":
false skips it), /v1/audio/speech makes audio files from text with a text-to-audio model
(OpenAI's speech API through the official client), SSE progress for both."""

from __future__ import annotations

import base64
import io
import json

import av
import httpx
import pytest

from omniloop.io import read_audio
from omniloop.request import DiffusionParams
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

LTX2_WARMUP = [DiffusionParams(steps=2, height=64, width=64, num_frames=9)]
SA_WARMUP = [DiffusionParams(steps=1)]


@pytest.fixture(scope="module")
def ltx2_server(ltx2_dir):
    with live_server(ltx2_dir, serve={"warmup": LTX2_WARMUP}, limits={"max_steps": 8, "max_frames": 17}) as server:
        yield server


@pytest.fixture(scope="module")
def audio_server(stable_audio_dir):
    with live_server(stable_audio_dir, serve={"warmup": SA_WARMUP}, limits={"max_steps": 8}) as server:
        yield server


def _streams(data: bytes) -> list[str]:
    with av.open(io.BytesIO(data)) as c:
        return sorted(s.type for s in c.streams)


def _sse(response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
def test_videos_come_with_sound_unless_skipped(ltx2_server):
    client = ltx2_server.client()
    body = {"num_frames": 9, "steps": 2, "seed": 1}
    video = client.videos.create(prompt="waves crash", size="64x64", extra_body=body)
    assert ltx2_server.wait_finished(video.id)["status"] == "completed"
    with_sound = httpx.get(f"{ltx2_server.url}/v1/videos/{video.id}/content").content
    assert _streams(with_sound) == ["audio", "video"]
    samples, rate = read_audio(with_sound)
    assert rate == 8000 and samples.shape[0] == 2
    with httpx.stream("GET", f"{ltx2_server.url}/v1/videos/{video.id}/events", timeout=60) as r:
        events = _sse(r)
    assert [n for n, _ in events if n == "progress"] and events[-1][0] == "final"
    final = events[-1][1]["output"]
    assert set(final["artifacts"]) >= {"video", "audio"}
    silent = client.videos.create(prompt="waves crash", size="64x64", extra_body={**body, "audio": False})
    assert ltx2_server.wait_finished(silent.id)["status"] == "completed"
    assert _streams(httpx.get(f"{ltx2_server.url}/v1/videos/{silent.id}/content").content) == ["video"]


def test_two_stage_over_http_reports_the_refined_size(ltx2_server):
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json={"prompt": "waves crash", "size": "64x64", "num_frames": 9,
                                                         "steps": 2, "node_params": {"upsample": {}}})
    assert r.status_code == 200, r.text
    job = ltx2_server.wait_finished(r.json()["id"])
    assert job["status"] == "completed" and job["size"] == "128x128"  # the upsampler doubles the base size
    assert list(job["metrics"]["node_s"]) == ["text_encode", "denoise", "upsample", "refine", "decode", "audio_decode"]
    with av.open(io.BytesIO(httpx.get(f"{ltx2_server.url}/v1/videos/{job['id']}/content").content)) as c:
        video = next(s for s in c.streams if s.type == "video")
        assert (video.codec_context.width, video.codec_context.height) == (128, 128)
        assert sorted(s.type for s in c.streams) == ["audio", "video"]


@pytest.mark.parametrize("node_params,message", [
    ({"refine": {"strength": 1.5}}, "node_params['refine'].strength: Value error, must be in [0, 1]"),
    ({"refine": {"strength": 0.2}}, "node_params['refine'].strength=0.2 with 3 steps runs no denoising step"),
])
def test_two_stage_bad_refine_strength_names_node_params(ltx2_server, node_params, message):
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json={"prompt": "x", "size": "64x64", "num_frames": 9, "steps": 2,
                                                         "node_params": node_params})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "node_params" and message in r.json()["error"]["message"]


def _png_url(color: tuple[int, int, int]) -> str:
    import base64

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 32), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_keyframes_over_http(ltx2_server):
    """LTX-2's guides on /v1/videos: a first frame and a last keyframe at strength 0.8 make the
    video (9 frames, sound), as the request plane's ImagePart(role="keyframe") does."""
    body = {"prompt": "waves crash", "size": "64x64", "num_frames": 9, "steps": 2, "seed": 1,
            "input_reference": {"image_url": _png_url((200, 40, 40))},
            "keyframes": [{"image": _png_url((20, 40, 220)), "frame_index": -1, "strength": 0.8}]}
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json=body)
    assert r.status_code == 200, r.text
    assert ltx2_server.wait_finished(r.json()["id"])["status"] == "completed"
    with av.open(io.BytesIO(httpx.get(f"{ltx2_server.url}/v1/videos/{r.json()['id']}/content").content)) as c:
        assert sorted(s.type for s in c.streams) == ["audio", "video"]
        assert sum(1 for _ in c.decode(video=0)) == 9


def test_a_video_keyframe_over_http(ltx2_server):
    """A control video as a guide on /v1/videos: ``keyframes[i].video`` (an mp4's 9 frames held
    from frame 0, as the request plane's VideoPart(role="keyframe"))."""
    import numpy as np

    from omniloop.io.video import encode_mp4

    frames = np.zeros((9, 32, 48, 3), np.uint8)
    for t in range(9):
        frames[t, :, 4 * t:4 * t + 8] = 255
    clip = "data:video/mp4;base64," + base64.b64encode(encode_mp4(frames, 8)).decode()
    body = {"prompt": "a bar moves", "size": "64x64", "num_frames": 9, "steps": 2, "seed": 1,
            "keyframes": [{"video": clip, "frame_index": 0, "strength": 0.9}]}
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json=body)
    assert r.status_code == 200, r.text
    assert ltx2_server.wait_finished(r.json()["id"])["status"] == "completed"
    with av.open(io.BytesIO(httpx.get(f"{ltx2_server.url}/v1/videos/{r.json()['id']}/content").content)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 9
    body["keyframes"][0]["frame_index"] = 1  # 9 frames from frame 1 run past a 9-frame video
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("keyframes[0]"), r.text
    assert "run past the video's 9 frames" in r.json()["error"]["message"]


@pytest.mark.parametrize("keyframe, param, words", [
    ({"frame_index": 9}, "keyframes[0].frame_index", "outside the video's 9 frames"),
    ({"frame_index": 2, "strength": 1.5}, "keyframes", "strength"),
    ({"frame_index": 0, "video": "AAAA"}, "keyframes", "exactly one of image"),
])
def test_bad_keyframes_name_the_field(ltx2_server, keyframe, param, words):
    body = {"prompt": "x", "size": "64x64", "num_frames": 9, "steps": 2,
            "keyframes": [{"image": _png_url((20, 40, 220)), **keyframe}]}
    r = httpx.post(f"{ltx2_server.url}/v1/videos", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error


def test_keyframes_on_a_model_without_them_are_refused(t2v_server):
    r = httpx.post(f"{t2v_server.url}/v1/videos", json={"prompt": "x", "size": "32x32", "num_frames": 5, "steps": 1,
                                                        "keyframes": [{"image": _png_url((1, 2, 3)), "frame_index": 2}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "keyframes" and "takes no keyframes" in error["message"]


def test_audio_true_on_a_silent_model_names_the_field(t2v_server):
    r = httpx.post(f"{t2v_server.url}/v1/videos", json={"prompt": "x", "size": "32x32", "num_frames": 5, "steps": 1,
                                                        "audio": True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "audio" and "makes no sound" in error["message"]


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_speech_endpoint_through_the_openai_client(audio_server, fmt):
    client = audio_server.client()
    response = client.audio.speech.create(model=audio_server.state.model.name, voice="alloy", input="a drum loop",
                                          response_format=fmt, extra_body={"seconds": 1.5, "steps": 2, "seed": 3})
    samples, rate = read_audio(response.read())
    assert rate == 128 and samples.shape == (2, 192)  # 1.5 s at the toy model's 128 Hz


def test_speech_sse_progress_then_the_audio(audio_server):
    body = {"input": "waves on a beach", "response_format": "wav", "stream_format": "sse", "steps": 3, "seed": 1,
            "seconds": 1.0}
    with httpx.stream("POST", f"{audio_server.url}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    names = [n for n, _ in events]
    assert names.count("progress") == 3 and names[-2:] == ["speech.audio.delta", "speech.audio.done"]
    import base64

    samples, rate = read_audio(base64.b64decode(events[-2][1]["audio"]))
    assert rate == 128 and samples.shape == (2, 128)
    assert events[-1][1]["status"] == "completed"


@pytest.mark.parametrize("body,param,message", [
    ({"input": "x", "response_format": "opus"}, "response_format", "pass one of ['flac', 'mp3', 'wav']"),
    ({"input": "x", "speed": 2.0, "response_format": "wav"}, "speed", "pass 1.0"),
    ({"input": "x", "response_format": "mp3"}, "response_format", "mp3 cannot carry 128 Hz audio"),
    ({"input": "x", "seconds": 30, "steps": 2, "response_format": "wav"}, "seconds",
     "this model makes up to 2.000 s of audio"),
    ({"input": "x", "seconds": 0.001, "steps": 2, "response_format": "wav"}, "seconds",
     "seconds=0.001: shorter than one sample at 128 Hz"),
    ({"input": "x", "steps": 50, "response_format": "wav"}, "steps", "limits.max_steps"),
    ({"input": ""}, "input", ""),
    ({"input": "x", "steps": 2, "num_inference_steps": 3, "response_format": "wav"}, "steps",
     "steps: 2 disagrees with num_inference_steps=3; pass one of them"),
])
def test_speech_bad_input_names_the_field(audio_server, body, param, message):
    r = httpx.post(f"{audio_server.url}/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_speech_from_a_video_model_is_refused(ltx2_server):
    r = httpx.post(f"{ltx2_server.url}/v1/audio/speech", json={"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "comes with /v1/videos" in r.json()["error"]["message"]


def test_videos_and_images_from_a_text_to_audio_model_point_to_the_speech_endpoint(audio_server):
    for path, body in (("/v1/videos", {"prompt": "x"}), ("/v1/images/generations", {"prompt": "x"})):
        r = httpx.post(f"{audio_server.url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "(tasks: ['t2a']); use /v1/audio/speech" in r.json()["error"]["message"]
