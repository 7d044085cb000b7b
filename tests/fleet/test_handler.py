"""The Dynamo request handlers over a real AsyncEngine, in process (no frontend): client
disconnect -> abort at the next step with state freed, concurrent requests batched,
errors typed for the frontend, drain, streaming frames, cost annotation, canary."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from omniloop.engine import AsyncEngine
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.serve.wire import ServedModel
from tests.fleet.conftest import requires_dynamo
from tests.media import assert_same_video, frame_diff, mp4_frames

pytestmark = [pytest.mark.fleet, requires_dynamo]


class FakeContext:
    """The parts of ``dynamo._core.Context`` the handler uses."""

    def __init__(self, request_id: str) -> None:
        self._id = request_id
        self._stopped = asyncio.Event()

    def id(self) -> str:
        return self._id

    def is_stopped(self) -> bool:
        return self._stopped.is_set()

    async def async_killed_or_stopped(self) -> bool:
        await self._stopped.wait()
        return True

    def stop(self) -> None:
        self._stopped.set()


@pytest.fixture
def engine(wan_t2v_dir):
    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits={"max_steps": 1000})
    yield eng
    eng.shutdown()


def make_handler(engine: AsyncEngine, drain_timeout_s: float = 30.0):
    from omniloop.serve.dynamo.handler import GenerationHandler
    from omniloop.serve.dynamo.metrics import WorkerMetrics

    model = ServedModel.of(engine, "wan-tiny")
    return GenerationHandler(engine, model, WorkerMetrics(engine), drain_timeout_s=drain_timeout_s)


def body(steps=3, frames=5, size=32, **fields):
    return {"model": "wan-tiny", "prompt": "a red circle", "size": f"{size}x{size}",
            "nvext": {"num_inference_steps": steps, "num_frames": frames, "seed": 1}, **fields}


async def collect(gen):
    return [chunk async for chunk in gen]


def test_disconnect_aborts_at_the_next_step_and_frees_state(engine):
    handler = make_handler(engine)
    ctx = FakeContext("gone")

    async def main():
        chunks = []
        async for chunk in handler.videos(body(steps=1000, stream=True), ctx):
            chunks.append(chunk)
            if len(chunks) == 3:  # three progress frames seen: the client goes away
                ctx.stop()
        return chunks

    before = engine.stats()
    chunks = asyncio.run(asyncio.wait_for(main(), 60))
    after = engine.stats()
    assert [c["nvext"]["frame"]["step"] for c in chunks[:3]] == [1, 2, 3]
    assert chunks[-1]["status"] == "failed" and "cancelled" in chunks[-1]["error"]
    assert after["cancelled"] - before["cancelled"] == 1 and after["completed"] == before["completed"]
    assert after["steps"] - before["steps"] < 50  # stopped at a step boundary, not after 1000 steps
    assert after["running"] == after["waiting"] == 0 and not engine.engine._requests  # state freed


def test_concurrent_requests_are_batched_not_serialized(engine):
    handler = make_handler(engine)

    async def main():
        return await asyncio.gather(*(collect(handler.videos(body(steps=20), FakeContext(f"c{i}"))) for i in range(4)))

    before = engine.stats()
    results = asyncio.run(asyncio.wait_for(main(), 60))
    after = engine.stats()
    assert after["batched_steps"] - before["batched_steps"] > 0
    for (response,) in results:
        assert response["status"] == "completed" and response["data"][0]["output_format"] == "mp4"
        assert len(mp4_frames(response["data"][0]["b64_json"])) == 5
        ann = response["nvext"]
        assert ann["predicted_cost_s"] > 0 and ann["actual_cost_s"] > 0 and ann["steps"] == 20


def test_bad_fields_raise_invalid_argument_with_our_message(engine):
    from dynamo.llm.exceptions import InvalidArgument

    handler = make_handler(engine)

    async def main(b):
        return await collect(handler.videos(b, FakeContext("bad")))

    with pytest.raises(InvalidArgument, match=r"diffusion.width=33 must be a multiple of 16; pass 32 or 48"):
        asyncio.run(main({**body(), "size": "33x32"}))
    with pytest.raises(InvalidArgument, match=r"nvext.num_inference_steps: Input should be greater than or equal to 1"):
        asyncio.run(main(body(steps=0)))
    assert engine.stats()["rejected"] == 1  # the engine's own validation rejected the first


def test_stream_yields_progress_frames_then_the_video_frames(engine):
    handler = make_handler(engine)
    chunks = asyncio.run(collect(handler.videos(body(steps=4, stream=True), FakeContext("s"))))
    kinds = [c["nvext"]["frame"]["kind"] for c in chunks]
    assert kinds == ["preview"] * 3 + ["video"] * 5  # a preview per step but the last, then 5 frames
    assert [c["status"] for c in chunks][-2:] == ["in_progress", "completed"]
    for c in chunks:
        image = Image.open(io.BytesIO(base64.b64decode(c["data"][0]["b64_json"])))
        assert image.format == "JPEG" and image.size == (32, 32)


def test_images_run_n_requests_and_return_pngs(engine):
    handler = make_handler(engine)
    req = {"model": "wan-tiny", "prompt": "a blue square", "size": "32x32", "n": 2,
           "nvext": {"num_inference_steps": 2, "seed": 3}}
    (response,) = asyncio.run(collect(handler.images(req, FakeContext("img"))))
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response["data"]]
    assert [(i.format, i.size) for i in images] == [("PNG", (32, 32))] * 2
    assert [a["seed"] for a in response["nvext"]["images"]] == [3, 4]


def test_drain_finishes_in_flight_work_then_refuses_new_requests(engine):
    from dynamo.llm.exceptions import EngineShutdown

    handler = make_handler(engine, drain_timeout_s=60)

    async def main():
        task = asyncio.ensure_future(collect(handler.videos(body(steps=100), FakeContext("inflight"))))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        await handler.drain()
        with pytest.raises(EngineShutdown, match="shutting down"):
            await collect(handler.videos(body(), FakeContext("late")))
        return await task

    (response,) = asyncio.run(asyncio.wait_for(main(), 60))
    assert response["status"] == "completed" and len(mp4_frames(response["data"][0]["b64_json"])) == 5


def test_drain_cancels_what_outlives_the_grace_period(engine):
    handler = make_handler(engine, drain_timeout_s=0.2)

    async def main():
        task = asyncio.ensure_future(collect(handler.videos(body(steps=1000, size=64, frames=17), FakeContext("slow"))))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        await handler.drain()
        return await task

    (response,) = asyncio.run(asyncio.wait_for(main(), 60))
    assert response["status"] == "failed" and "drain grace period (0.2 s) ran out" in response["error"]


def test_cost_is_a_metric_and_inflight_cost_returns_to_zero(engine):
    handler = make_handler(engine)
    asyncio.run(collect(handler.videos(body(), FakeContext("m"))))
    reg = handler.metrics.registry
    assert reg.get_sample_value("omniloop_request_predicted_cost_seconds_count") == 1
    assert reg.get_sample_value("omniloop_request_predicted_cost_seconds_sum") > 0
    assert reg.get_sample_value("omniloop_request_actual_cost_seconds_count") == 1
    assert reg.get_sample_value("omniloop_inflight_predicted_cost_seconds") == pytest.approx(0.0, abs=1e-9)
    assert reg.get_sample_value("omniloop_requests_running") == 0
    assert reg.get_sample_value("omniloop_requests_finished_total", {"status": "completed"}) == 1


def test_health_canary_answers_without_generating(engine):
    handler = make_handler(engine)
    (response,) = asyncio.run(collect(handler.videos({"_HEALTH_CHECK": True}, FakeContext("hc"))))
    assert response["status"] == "completed" and response["nvext"] == {"alive": True}
    assert engine.stats()["steps"] == 0


def test_engine_admission_errors_map_to_the_frontends_status_codes():
    from dynamo.llm.exceptions import EngineShutdown, HttpError, InvalidArgument

    from omniloop.engine import DoesNotFit, EngineDeadError, QueueFull
    from omniloop.request import ErrorKind
    from omniloop.serve.dynamo.handler import dynamo_error

    full = dynamo_error(QueueFull("queue is full (64 waiting); retry later"))
    assert isinstance(full, HttpError) and full.code == 429
    draining = QueueFull("engine is draining and accepts no new requests", kind=ErrorKind.DRAINING)
    assert isinstance(dynamo_error(draining), EngineShutdown)
    assert isinstance(dynamo_error(EngineDeadError("pool failed 4 times")), EngineShutdown)
    too_big = dynamo_error(DoesNotFit("request needs ~9 GiB; lower the resolution"))
    assert isinstance(too_big, InvalidArgument) and "lower the resolution" in str(too_big)


def test_worker_config_and_modalities_say_what_to_pass():
    from omniloop.request import TaskType
    from omniloop.serve.dynamo.worker import WorkerConfig, _served_modalities

    with pytest.raises(ValueError, match=r"discovery_backend='zk'; pass one of \['etcd', 'file', 'kubernetes', 'mem'\]"):
        WorkerConfig(model="m", discovery_backend="zk")
    with pytest.raises(ValueError, match=r"modalities=\('audio',\); pass a non-empty subset of \['videos', 'images'\]"):
        WorkerConfig(model="m", modalities=("audio",))
    assert WorkerConfig(model="/ckpt/Wan2.1-T2V-1.3B-Diffusers").name == "Wan2.1-T2V-1.3B-Diffusers"
    t2v = ServedModel(name="wan", tasks=frozenset({TaskType.T2V, TaskType.T2I}), defaults=GenerationDefaults())
    i2v = ServedModel(name="wan-i2v", tasks=frozenset({TaskType.I2V}), defaults=GenerationDefaults())
    assert _served_modalities(t2v, None) == ("videos", "images")
    assert _served_modalities(i2v, None) == ("videos",)
    with pytest.raises(ValueError, match=r"modalities \['images'\] are not served by 'wan-i2v'"):
        _served_modalities(i2v, ("images",))


@pytest.fixture
def far_engine(far_dir):
    eng = AsyncEngine.from_pretrained(far_dir, device="cpu", dtype="float32")
    yield eng
    eng.shutdown()


def test_stream_sends_a_causal_models_chunks_as_they_are_made(far_engine):
    handler = make_handler(far_engine)
    request = {"model": "wan-tiny", "prompt": "a red circle", "size": "64x32",
               "nvext": {"num_inference_steps": 2, "num_frames": 17, "seed": 1}, "stream": True}
    chunks = asyncio.run(collect(handler.videos(request, FakeContext("c"))))
    frames = [c for c in chunks if c["nvext"]["frame"]["kind"] == "video"]
    assert [c["nvext"]["frame"]["index"] for c in frames] == list(range(17))  # each frame once, in order
    # chunks (1, 2, 2) of latent frames = 1 + 8 + 8 video frames, each chunk's frames out before the
    # next chunk's denoising (its mid-chunk preview) began
    kinds = [c["nvext"]["frame"]["kind"] for c in chunks]
    assert kinds == ["preview", "video"] + ["preview"] + ["video"] * 8 + ["preview"] + ["video"] * 8
    assert [c["status"] for c in chunks][-1] == "completed"


def _png_b64(color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_a_last_image_makes_a_first_last_frame_video(wan_i2v_dir):
    """Wan2.2 I2V through the worker: ``last_image`` beside ``input_reference``, top level or as
    Dynamo's frontend forwards a client's extra_body (extra_args.media_passthrough), makes the same
    video, and the last frame changes it (the condition holds it)."""
    eng = AsyncEngine.from_pretrained(wan_i2v_dir, device="cpu", dtype="float32")
    try:
        handler = make_handler(eng)
        first, last = _png_b64((10, 200, 90)), _png_b64((200, 20, 200))
        base = body(steps=2, input_reference=first)

        async def main():
            calls = [{**base, "last_image": last},
                     {**base, "extra_args": {"media_passthrough": {"last_image": "data:image/png;base64," + last}}},
                     base]
            # one after another: requests that arrive together batch as their timing falls, and a
            # batched row's floats may round apart from a solo one's (tests/media.py)
            return [await collect(handler.videos(b, FakeContext(f"flf{i}"))) for i, b in enumerate(calls)]

        (top,), (nested,), (only_first,) = asyncio.run(asyncio.wait_for(main(), 120))
        assert top["status"] == nested["status"] == only_first["status"] == "completed"
        videos = [r["data"][0]["b64_json"] for r in (top, nested, only_first)]
        assert len(mp4_frames(videos[0])) == 5
        assert_same_video(videos[0], videos[1])
        assert frame_diff(videos[0], videos[2])[0] > 1  # measured 2.7 levels: the last frame holds
    finally:
        eng.shutdown()
