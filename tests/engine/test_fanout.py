"""Graph fan-out: one-shot nodes of one request whose inputs are ready run together, so the
two decodes after a joint denoise do not serialize the request's critical path."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, NodeWork, SchedulingPolicy
from omniloop.engine.fanout import FanOutPool, ready_siblings
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import OmniRequest, TaskType, TensorArtifact, TextPart
from tests.engine_plans import record_plans

WORK_S = 0.5  # long beside a loaded 2-core box's thread-start jitter (0.3 with a 0.8 overlap bound flaked once)


@dataclass
class Source(StageBase):
    outputs = {"latents": TensorArtifact}  # type: ignore[assignment]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ctx.write(state, "latents", TensorArtifact(tensor=torch.ones(4)))


@dataclass
class Decoder(StageBase):
    """Stands for a decoder: waits ``WORK_S`` (as a GPU kernel or a GIL-free op would) and
    records when it ran."""

    inputs = {"latents": TensorArtifact}  # type: ignore[assignment]
    outputs = {"out": TensorArtifact}  # type: ignore[assignment]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        start = time.perf_counter()
        time.sleep(WORK_S)
        x = ctx.read(state, "latents", TensorArtifact).tensor
        ctx.write(state, "out", TensorArtifact(tensor=torch.stack([x.sum(), torch.tensor(start),
                                                                   torch.tensor(time.perf_counter())])))


def _pipeline() -> Pipeline:
    spec = PipelineSpec(
        name="fanout-demo", family="test", tasks={TaskType.T2VS}, components={},
        nodes=(Node("source", Source()), Node("video_decode", Decoder(), outputs={"out": "video_out"}),
               Node("audio_decode", Decoder(), outputs={"out": "audio_out"})),
        outputs={"video_out": "video_out", "audio_out": "audio_out"},
    )
    return Pipeline(spec=spec, components={}, device=torch.device("cpu"), dtype=torch.float32)


def _run(pipeline: Pipeline, fan_out: bool):
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(fan_out=fan_out)))
    plans = record_plans(engine)
    rid = engine.add_request(OmniRequest(task=TaskType.T2VS, inputs=[TextPart(text="x")]))
    t0 = time.perf_counter()
    engine.run_until_done(rid)
    return engine.pop_output(rid), time.perf_counter() - t0, plans.works()


def test_ready_siblings_follow_the_edges():
    nodes = list(_pipeline().spec.nodes_in_order())
    assert [n.name for n in ready_siblings(nodes, 0)] == []  # the decoders read the source's latents
    assert [n.name for n in ready_siblings(nodes, 1)] == ["audio_decode"]
    assert ready_siblings(nodes, 2) == ()


def test_two_ready_decodes_overlap_instead_of_serializing():
    pipeline = _pipeline()
    out, wall, works = _run(pipeline, fan_out=True)
    assert out.status.value == "completed", out.error
    assert NodeWork("video_decode", (out.request_id,), ("audio_decode",)) in works
    video, audio = out.artifacts["video_out"].tensor, out.artifacts["audio_out"].tensor
    assert video[0] == audio[0] == 4  # both read the source's latents
    overlap = min(video[2], audio[2]) - max(video[1], audio[1])
    assert overlap > 0.5 * WORK_S  # they ran at the same time (serialized, the overlap is <= 0)
    assert out.metrics.node_s["video_decode"] >= WORK_S and out.metrics.node_s["audio_decode"] >= WORK_S
    serial, serial_wall, serial_works = _run(pipeline, fan_out=False)
    assert all(not w.parallel for w in serial_works)
    assert serial_wall >= 2 * WORK_S and wall < 1.7 * WORK_S  # the critical path: one decode, not two
    s_video, s_audio = serial.artifacts["video_out"].tensor, serial.artifacts["audio_out"].tensor
    assert s_audio[1] >= s_video[2]  # one after the other


def test_a_failing_sibling_fails_the_request_and_the_engine_goes_on():
    @dataclass
    class Broken(Decoder):
        def forward(self, ctx, state):
            raise RuntimeError("vocoder exploded")

    spec = PipelineSpec(name="fanout-broken", family="test", tasks={TaskType.T2VS}, components={},
                        nodes=(Node("source", Source()), Node("video_decode", Decoder(), outputs={"out": "video_out"}),
                               Node("audio_decode", Broken(), outputs={"out": "audio_out"})),
                        outputs={"video_out": "video_out", "audio_out": "audio_out"})
    pipeline = Pipeline(spec=spec, components={}, device=torch.device("cpu"), dtype=torch.float32)
    out, _, _ = _run(pipeline, fan_out=True)
    assert out.status.value == "failed" and "vocoder exploded" in out.error
    assert _run(_pipeline(), fan_out=True)[0].status.value == "completed"


@pytest.mark.slow
def test_ltx2_decodes_fan_out_with_unchanged_outputs(ltx2_dir):
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.request import DiffusionParams, OutputSpec

    pipeline = load_pipeline(ltx2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    request = OmniRequest(task=TaskType.T2VS, inputs=[TextPart(text="waves crash")], outputs=OutputSpec(),
                          diffusion=DiffusionParams(steps=2, height=64, width=64, num_frames=9, seed=4))
    outs = {}
    for fan_out in (True, False):
        engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(fan_out=fan_out)))
        plans = record_plans(engine)
        with torch.inference_mode():
            rid = engine.add_request(request.model_copy(update={"request_id": f"r-{fan_out}"}))
            engine.run_until_done(rid)
        outs[fan_out] = engine.pop_output(rid)
        fanned = [w for w in plans.node_runs() if w.parallel]
        assert fanned == ([NodeWork("decode", (rid,), ("audio_decode",))] if fan_out else [])
    assert torch.equal(outs[True].video.frames, outs[False].video.frames)
    assert torch.equal(outs[True].audio.samples, outs[False].audio.samples)


def test_workers_run_with_the_callers_thread_count():
    """A worker thread fixes its intra-op count at its first op; later calls take the caller's
    count, so a node's floats do not depend on which thread of the pool ran it."""
    before = torch.get_num_threads()
    pool = FanOutPool(torch.device("cpu"), workers=2)
    try:
        torch.set_num_threads(2)
        both = threading.Barrier(2)
        started: list[int] = []
        pool.run([lambda: (started.append(torch.get_num_threads()), both.wait(5))] * 2)  # both workers fix 2
        assert started == [2, 2]
        torch.set_num_threads(1)
        seen: list[int] = []
        pool.run([lambda: (seen.append(torch.get_num_threads()), both.wait(5))] * 2)  # the same two threads
        assert seen == [1, 1]
    finally:
        pool.close()
        torch.set_num_threads(before)
