"""``nvext.stream_format: "events"`` on the Dynamo worker (design §6.3.6 A3's wire format),
over a real AsyncEngine in process: every OmniEvent is one typed message with its
schema_version, a causal model's chunks go out as fMP4 fragments whose concatenation PyAV
decodes, a whole video closes the stream as one fragment, audio chunks as PCM."""

from __future__ import annotations

import asyncio
import base64
import io

import av
import numpy as np
import pytest
import torch

from omniloop.engine import AsyncEngine
from omniloop.request import SCHEMA_VERSION, ArtifactEvent, AudioArtifact, FinalEvent, OmniOutput, RequestStatus, TextArtifact
from omniloop.serve.dynamo.events import EventMessages
from tests.fleet.conftest import requires_dynamo
from tests.fleet.test_handler import FakeContext, body, collect, make_handler

pytestmark = [pytest.mark.fleet]


def events_body(**fields):
    b = body(**fields)
    return {**b, "stream": True, "nvext": {**b["nvext"], "stream_format": "events"}}


def fmp4_bytes(messages) -> bytes:
    return b"".join(base64.b64decode(d["b64_json"]) for m in messages for d in m["data"] if d["output_format"] == "fmp4")


def decode(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def check_typed(messages, request_id):
    events = [m["nvext"]["event"] for m in messages]
    assert all(e["schema_version"] == SCHEMA_VERSION and e["request_id"] == request_id for e in events)
    assert [e["type"] for e in events][-1] == "final" and "final" not in [e["type"] for e in events][:-1]
    assert [m["status"] for m in messages][-1] == "completed"
    assert all(m["status"] == "in_progress" for m in messages[:-1])
    return events


@pytest.fixture
def far_engine(far_dir):
    eng = AsyncEngine.from_pretrained(far_dir, device="cpu", dtype="float32")
    yield eng
    eng.shutdown()


@pytest.fixture
def wan_engine(wan_t2v_dir):
    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    yield eng
    eng.shutdown()


@requires_dynamo
def test_causal_chunks_stream_as_fmp4_fragments_that_concatenate_into_one_mp4(far_engine):
    handler = make_handler(far_engine)
    request = {"model": "wan-tiny", "prompt": "a red circle", "size": "64x32", "stream": True,
               "nvext": {"num_inference_steps": 2, "num_frames": 17, "seed": 1, "stream_format": "events"}}
    messages = asyncio.run(collect(handler.videos(request, FakeContext("ev"))))
    events = check_typed(messages, "ev")
    chunks = [m for m in messages if any(x["kind"] == "video" for x in m["nvext"]["media"])]
    # chunks (1, 2, 2) of latent frames = 1 + 8 + 8 frames, each its own fragment, sent as made
    assert [m["nvext"]["media"][0]["index"] for m in chunks] == [0, 1, 2]
    assert [m["nvext"]["media"][0]["init"] for m in chunks] == [True, False, False]
    assert all(m["nvext"]["event"]["type"] == "artifact" for m in chunks)
    assert "progress" in [e["type"] for e in events]
    assert messages[-1]["data"] == []  # the chunks carried the whole video
    frames = decode(fmp4_bytes(messages))
    assert len(frames) == 17 and frames[0].shape == (32, 64, 3)
    # the stream is the video the JPEG mode sends (lossy codecs both: compare coarsely)
    jpeg = asyncio.run(collect(handler.videos({**request, "nvext": {**request["nvext"], "stream_format": "jpeg"}},
                                              FakeContext("jp"))))
    ref = [m for m in jpeg if m["nvext"]["frame"]["kind"] == "video"]
    first = np.asarray(av.open(io.BytesIO(base64.b64decode(ref[0]["data"][0]["b64_json"]))).decode(video=0).__next__()
                       .to_ndarray(format="rgb24"), np.float32)
    assert np.abs(first - frames[0].astype(np.float32)).mean() < 12


@requires_dynamo
def test_a_whole_video_closes_the_stream_as_one_fragment(wan_engine):
    handler = make_handler(wan_engine)
    messages = asyncio.run(collect(handler.videos(events_body(steps=3, frames=5), FakeContext("w"))))
    events = check_typed(messages, "w")
    assert [e["type"] for e in events].count("progress") >= 1
    assert all(m["data"] == [] for m in messages[:-1])  # no previews: progress events carry progress
    final = messages[-1]
    assert final["nvext"]["media"][0] == {"kind": "video", "format": "fmp4", "mime": final["nvext"]["media"][0]["mime"],
                                         "index": 0, "init": True}
    assert final["nvext"]["event"]["output"]["status"] == "completed" and final["nvext"]["weight_version"] is not None
    frames = decode(fmp4_bytes(messages))
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


@requires_dynamo
def test_stream_format_is_checked_naming_the_field(wan_engine):
    from dynamo.llm.exceptions import InvalidArgument

    handler = make_handler(wan_engine)

    async def main(b):
        return await collect(handler.videos(b, FakeContext("bad")))

    bad = events_body()
    with pytest.raises(InvalidArgument, match=r"nvext.stream_format: expected 'jpeg' or 'events', got 'gif'"):
        asyncio.run(main({**bad, "nvext": {**bad["nvext"], "stream_format": "gif"}}))
    with pytest.raises(InvalidArgument, match=r"nvext.stream_format: 'events' is a streamed answer; pass stream: true"):
        asyncio.run(main({**bad, "stream": False}))
    plain = body(stream=True)  # through the frontend, an extra body field arrives as media_passthrough
    with pytest.raises(InvalidArgument, match=r"extra_args.media_passthrough.stream_format: expected 'jpeg' or"):
        asyncio.run(main({**plain, "extra_args": {"media_passthrough": {"stream_format": "gif"}}}))


def test_audio_chunks_are_pcm_and_text_deltas_carry_no_media():
    rng = np.random.default_rng(0)
    parts = [torch.from_numpy(rng.uniform(-1, 1, (2, n)).astype(np.float32)) for n in (160, 240)]
    messages = EventMessages()
    pcm = b""
    for i, samples in enumerate(parts):
        m = messages.media(ArtifactEvent(request_id="a", name="audio", artifact=AudioArtifact(samples=samples, sample_rate=16000)))
        assert m.media == [{"kind": "audio", "format": "pcm_s16le", "sample_rate": 16000, "channels": 2, "index": i}]
        pcm += base64.b64decode(m.data[0]["b64_json"])
    text = messages.media(ArtifactEvent(request_id="a", name="text", artifact=TextArtifact(text="hel")))
    assert text.data == [] and text.media == []
    whole = torch.cat(parts, dim=1)
    ints = np.frombuffer(pcm, "<i2").reshape(-1, 2).T  # interleaved -> [channels, n]
    assert np.abs(ints / 32767.0 - whole.numpy()).max() < 1 / 32767 + 1e-6
    done = OmniOutput(request_id="a", status=RequestStatus.COMPLETED,
                      artifacts={"audio": AudioArtifact(samples=whole, sample_rate=16000)})
    assert messages.media(FinalEvent(request_id="a", output=done)).data == []  # the chunks carried it


def test_whole_audio_closes_the_stream_as_wav():
    from omniloop.io.audio import read_audio

    samples = torch.linspace(-0.5, 0.5, 800).reshape(1, 800)
    done = OmniOutput(request_id="a", status=RequestStatus.COMPLETED,
                      artifacts={"audio": AudioArtifact(samples=samples, sample_rate=16000)})
    m = EventMessages().media(FinalEvent(request_id="a", output=done))
    assert [d["output_format"] for d in m.data] == ["wav"]
    decoded, rate = read_audio(base64.b64decode(m.data[0]["b64_json"]))
    assert rate == 16000 and decoded.shape == (1, 800)
    assert np.abs(decoded - samples.numpy()).max() < 1e-4
