"""A streaming graph split over two role pools (engine/role_pool.py): the producer loop on pool
``thinker``, its consumer on pool ``talker``; the consumer's chunks cross through the connectors
(pool -> engine -> pool, its channel mirrored on the pool) and the result equals one process,
with the consumer stepping before the producer's last step."""

from __future__ import annotations

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.role_pool import launch_role_engine
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.streams import StreamEdge
from omniloop.request import ProgressEvent, RequestStatus
from tests.engine.test_streaming_edges import _engine, _pipeline, _run

STREAMS = (StreamEdge("tokens", capacity=2),)
DEPLOY = DeployConfig(device="cpu", dtype="float32", pools={"thinker": {}, "talker": {}},
                      placement={"produce": "thinker", "consume": "talker"})


def build_streamed(model: str, deploy: DeployConfig, device: torch.device) -> Pipeline:
    """Each pool's pipeline (a module-level function: the worker process imports it)."""
    return _pipeline(streams=STREAMS)[0]


@pytest.mark.slow  # two worker processes start (a forkserver, every family imported): ~30 s on 2 busy cores
def test_a_stream_between_two_pools_equals_one_process_and_the_consumer_starts_before_the_producer_ends():
    events: list = []
    engine = launch_role_engine("fake", DEPLOY, pipeline=_pipeline(streams=STREAMS)[0], build=build_streamed,
                                event_sink=events.append)
    try:
        got = _run(engine, "r0", "r1", steps=6)
        sent = [t for t in engine.transfers() if t.bytes > 0]
    finally:
        engine.close()
    want = _run(_engine(_pipeline()[0]), "r0", "r1", steps=6)
    for rid in ("r0", "r1"):
        assert got[rid].status is RequestStatus.COMPLETED, got[rid].failure
        for name in ("text", "audio"):
            assert torch.equal(got[rid].artifacts[name].tensor, want[rid].artifacts[name].tensor)
    steps = [(e.node, e.request_id) for e in events if isinstance(e, ProgressEvent)]
    first_consume = steps.index(("consume", "r0"))
    last_produce = max(i for i, s in enumerate(steps) if s == ("produce", "r0"))
    assert first_consume < last_produce
    assert {("thinker", "main"), ("main", "talker")} <= {(t.source, t.target) for t in sent}  # chunks crossed
