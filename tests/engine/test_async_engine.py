"""AsyncEngine: a background engine thread behind an asyncio API."""

from __future__ import annotations

import asyncio

import pytest

from omniloop.engine import AsyncEngine, QueueFull, RequestRejected, UnknownRequest
from omniloop.request import FinalEvent, ProgressEvent, RequestStatus, StatusEvent
from tests.engine.conftest import req


@pytest.fixture
def engine(wan_t2v_dir):
    # the deploy limits are the engine's admission's: the long drain request takes 400 steps
    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits={"max_steps": 1000})
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


def test_a_duplicate_id_is_rejected_and_the_live_stream_still_completes(engine):
    async def main():
        live = asyncio.create_task(engine.generate(req(1, steps=6, rid="dup")))
        while not engine.engine.is_tracked("dup"):
            await asyncio.sleep(0.001)
        rejected = engine.stats()["rejected"]
        with pytest.raises(RequestRejected, match="request_id 'dup' is already in use"):
            engine.submit(req(2, steps=2, rid="dup"))
        with pytest.raises(RequestRejected, match="already in use"):
            async for _ in engine.stream(req(3, steps=2, rid="dup")):
                pass
        assert engine.stats()["rejected"] == rejected + 2  # each rejection counted once
        return await live

    out = asyncio.run(main())
    assert out.status is RequestStatus.COMPLETED and out.metrics.steps == 6 and out.metrics.seed == 1
    assert engine.stats()["streams"] == 0 and engine.stats()["tracked"] == 0


def test_a_stream_closed_early_aborts_its_request(engine):
    async def main():
        stream = engine.stream(req(4, steps=200, rid="gone"))
        async for event in stream:
            if isinstance(event, ProgressEvent) and event.step == 2:
                break  # the client went away mid-run
        await stream.aclose()
        while engine.stats()["tracked"] or engine.stats()["running"]:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    stats = engine.stats()
    assert stats["cancelled"] == 1 and stats["streams"] == 0 and stats["steps"] < 200


@pytest.fixture
def roomy_engine(wan_t2v_dir):
    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", max_queue=2048)
    yield eng
    eng.shutdown()


def test_a_thousand_dropped_streams_leave_every_table_empty_and_memory_flat(roomy_engine):
    """Clients that disconnect right after submitting (half close the stream, half cancel the
    task reading it): each request is aborted and forgotten, nothing accumulates."""
    import gc
    import sys

    engine = roomy_engine

    async def drop(i: int) -> None:
        stream = engine.stream(req(i, steps=1, rid=f"d{i}", size=16, frames=1))
        if i % 2:
            await stream.__anext__()  # the QUEUED status, then the client closes
            await stream.aclose()
            return
        first = asyncio.Event()

        async def read():
            async for _ in stream:
                first.set()

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()  # the client's handler task is cancelled (a disconnect)
        with pytest.raises(asyncio.CancelledError):
            await task

    async def wave(start: int, n: int) -> None:
        for i in range(start, start + n):
            await drop(i)
        deadline = asyncio.get_running_loop().time() + 60
        while engine.stats()["tracked"] or engine.engine.has_unfinished():
            assert asyncio.get_running_loop().time() < deadline, f"still tracked: {engine.stats()}"
            await asyncio.sleep(0.01)

    def footprint() -> tuple[int, int]:
        gc.collect()
        return len(gc.get_objects()), sys.getallocatedblocks()

    asyncio.run(wave(0, 100))  # warm: caches, the cost model's keys, lazily built objects
    objects, blocks = footprint()
    asyncio.run(wave(100, 1000))
    objects_after, blocks_after = footprint()
    stats = engine.stats()
    assert stats["tracked"] == 0 and stats["streams"] == 0 and stats["waiting"] == 0 and stats["running"] == 0
    assert stats["cancelled"] + stats["completed"] == 1100 and stats["failed"] == 0
    assert engine.engine.scheduler.memory.reserved_bytes == 0
    # flat: a leak of one output per stream alone would add >= 1,000 objects
    assert objects_after - objects < 500, (objects, objects_after)
    assert blocks_after - blocks < 20_000, (blocks, blocks_after)
