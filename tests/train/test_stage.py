"""ShardClock: a shard starts only when it is expected to end before the call's deadline."""

from __future__ import annotations

import pytest

from omniloop.train.recipes import stage


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(stage.time, "monotonic", fake.monotonic)
    return fake


def test_shard_that_would_end_past_the_deadline_is_not_started(clock_time):
    # the session-4 failure: 75 s shards, deadline at 540 s; the 6th shard started at ~535 s
    clock = stage.ShardClock(deadline=1000.0 + 540)
    started = 0
    while clock.may_start():
        started += 1
        clock_time.now += 75.0
        clock.finished_one()
    assert started == 7  # 7 x 75 = 525 s; an 8th would end at 600 s
    assert clock_time.now <= 1000.0 + 540


def test_first_shard_always_starts_and_no_deadline_never_stops(clock_time):
    late = stage.ShardClock(deadline=1000.0 - 1)  # already past: still one shard per call (progress)
    assert late.may_start()
    late.finished_one()
    assert not late.may_start()
    free = stage.ShardClock(deadline=None)
    for _ in range(3):
        clock_time.now += 1e6
        free.finished_one()
        assert free.may_start()
    assert free.seconds == pytest.approx(3e6)
