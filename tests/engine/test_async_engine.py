"""AsyncEngine: a background engine thread behind an asyncio API."""

from __future__ import annotations

import asyncio

import pytest

from omniloop.engine import AsyncEngine, QueueFull, RequestRejected, UnknownRequest
from omniloop.request import FinalEvent, ProgressEvent, RequestStatus, StatusEvent
from tests.engine.conftest import req


@pytest.fixture
def engine(wan_t2v_dir):
    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    yield eng
    eng.shutdown()


def test_concurrent_generate_and_stats(engine):
    async def main():
        outs = await asyncio.gather(*(engine.generate(req(s, steps=3, rid=f"a{s}")) for s in range(3)))
        return outs

    outs = asyncio.run(main())
    assert [o.status for o in outs] == [RequestStatus.COMPLETED] * 3
    assert all(o.video is not None and o.video.frames.shape == (5, 32, 32, 3) for o in outs)
    stats = engine.stats()
    assert stats["completed"] == 3 and stats["alive"] and stats["waiting"] == 0 and stats["running"] == 0
    assert stats["steps"] >= 3


def test_stream_yields_status_progress_final(engine):
    async def main():
        return [e async for e in engine.stream(req(1, steps=4, rid="s1"))]

    events = asyncio.run(main())
    assert isinstance(events[0], StatusEvent) and events[0].status is RequestStatus.QUEUED
    assert [e.step for e in events if isinstance(e, ProgressEvent)] == [1, 2, 3, 4]
    assert isinstance(events[-1], FinalEvent) and events[-1].output.status is RequestStatus.COMPLETED
    assert all(e.to_dict()["schema_version"] for e in events)


def test_abort_mid_stream(engine):
    async def main():
        seen = []
        async for event in engine.stream(req(2, steps=40, rid="long")):
            seen.append(event)
            if isinstance(event, ProgressEvent) and event.step == 2:
                await engine.abort("long")
        return seen

    events = asyncio.run(main())
    final = events[-1]
    assert final.output.status is RequestStatus.CANCELLED
    assert max(e.step for e in events if isinstance(e, ProgressEvent)) < 40


def test_bad_input_raises_at_submit_and_engine_survives(engine):
    async def main():
        with pytest.raises(RequestRejected, match="num_frames=6 must be 4k\\+1"):
            await engine.generate(req(1, frames=6))
        with pytest.raises(UnknownRequest):
            await engine.abort("nobody")
        return await engine.generate(req(3, steps=2, rid="ok"))

    assert asyncio.run(main()).status is RequestStatus.COMPLETED


def test_drain_stops_admission_and_cancels_after_timeout(engine):
    async def main():
        long = asyncio.create_task(engine.generate(req(4, steps=400, rid="forever")))
        await asyncio.sleep(0.2)
        await engine.drain(timeout=0.3)
        with pytest.raises(QueueFull, match="draining"):
            engine.submit(req(5, rid="late"))
        return await long

    out = asyncio.run(main())
    assert out.status is RequestStatus.CANCELLED


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory nor a built-in model name"):
        AsyncEngine.from_pretrained(tmp_path / "missing", device="cpu")
