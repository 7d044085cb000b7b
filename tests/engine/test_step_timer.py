"""The engine's hot path never calls ``torch.cuda.synchronize``: on a GPU a step is timed by
a CUDA event pair read once the device has passed it, and the cost model learns the time
a step later. Run on the CPU with the event timer given fake events (the real timer code,
fake device)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.cost_model import ItemCost
from omniloop.engine.step_timer import CudaEventTimer, WallTimer, step_timer_for
from tests.engine.conftest import req, run_all

STEP_MS = 25.0


class FakeEvent:
    """A CUDA event whose GPU work completes one ``query`` after it is recorded (the device
    runs a step behind the host)."""

    log: list[str] = []

    def __init__(self) -> None:
        self.recorded = False
        self.queries = 0

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 1

    def synchronize(self) -> None:
        FakeEvent.log.append("event.synchronize")
        self.queries = 1  # done now

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.recorded and end.recorded
        return STEP_MS


@pytest.fixture
def no_device_sync(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
    return calls


def test_the_timer_follows_the_device():
    assert isinstance(step_timer_for(torch.device("cpu")), WallTimer)
    assert isinstance(step_timer_for(torch.device("cuda", 0)), CudaEventTimer)  # builds no event yet


def test_default_cpu_path_never_synchronizes(make_engine, no_device_sync):
    engine = make_engine(max_batch=2)
    for s in range(2):
        engine.add_request(req(s, steps=3, rid=f"r{s}"))
    outs, _ = run_all(engine)
    assert all(o.status.value == "completed" for o in outs.values())
    assert no_device_sync == []


def test_event_timer_reads_step_times_lazily_without_a_device_sync(wan_pipeline, no_device_sync):
    from omniloop.engine import Engine, EngineConfig, SchedulingPolicy

    FakeEvent.log.clear()
    timer = CudaEventTimer(torch.device("cuda"), event=FakeEvent, stream=lambda: None)
    engine = Engine(wan_pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=1)), step_timer=timer)
    engine.add_request(req(5, steps=4, rid="timed"))
    flops = engine._requests["timed"].estimates.nodes["denoise"].flops_per_step
    observed = []
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            observed.append(timer.pending)
    out = engine.pop_output("timed")
    assert no_device_sync == []  # never torch.cuda.synchronize
    assert max(observed) >= 1  # a step's time was still pending while the engine went on
    assert timer.pending == 0
    # every step's device time reached the metrics (node_s also holds the loop's init) and the cost model
    init_s = out.metrics.node_s["denoise"] - 4 * STEP_MS / 1000
    assert 0 < init_s < out.metrics.run_s
    assert engine.cost_model.predict(ItemCost("denoise", "step", flops)) == pytest.approx(STEP_MS / 1000)
    assert FakeEvent.log.count("event.synchronize") <= 1  # at most once, when the request ended
