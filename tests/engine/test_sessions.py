"""Live sessions on the engine (FAR, tiny random checkpoint): an open-ended rollout goes on
chunk after chunk, keeps only the latents its next context pass needs, takes prompts and
flushes between steps, and a paced session waits for playback while other work runs."""

from __future__ import annotations

import time

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.errors import UnknownRequest
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.loops.chunk import Flush
from omniloop.request import (ArtifactEvent, DiffusionParams, Modality, OmniRequest, OutputSpec, RequestStatus,
                              TaskType, TextPart, VideoChunkArtifact)
from tests.ext.factories import MemoText


@pytest.fixture(scope="module")
def pipeline(far_dir):
    p = load_pipeline(far_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    p.components["text_encoder"] = MemoText(p.components["text_encoder"])
    return p


def _session(rid: str, *, chunks: int = 4, fps: int = 16, realtime: bool = False, seed: int = 1) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text="a red circle")],
                       diffusion=DiffusionParams(height=32, width=64, steps=1, seed=seed, fps=fps),
                       node_params={"rollout": {"open_ended": True, "max_chunks": chunks, "realtime": realtime,
                                                "lead_chunks": 1}})


class _Chunks:
    def __init__(self):
        self.by_request: dict[str, list[tuple[float, VideoChunkArtifact]]] = {}

    def __call__(self, event):
        if isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, VideoChunkArtifact):
            self.by_request.setdefault(event.request_id, []).append((time.perf_counter(), event.artifact))


def _engine(pipeline, sink=None):
    return Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=4)), event_sink=sink)


def _run(engine, on_step=None):
    outs = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
            if on_step is not None:
                on_step()
            idle = engine.idle_s()
            if idle:
                time.sleep(min(idle, 0.05))
    return outs


def test_a_session_makes_chunk_after_chunk_keeping_only_what_it_needs(pipeline):
    chunks = _Chunks()
    engine = _engine(pipeline, chunks)
    engine.add_request(_session("s", chunks=5))
    held = []

    def watch():
        req = engine.scheduler.running.get("s")
        if req is not None and req.loop is not None:
            held.append(len(req.loop.clean))

    outs = _run(engine, watch)
    assert outs["s"].status is RequestStatus.COMPLETED
    arts = [a for _, a in chunks.by_request["s"]]
    assert [a.index for a in arts] == [0, 1, 2, 3, 4] and all(a.num_chunks is None for a in arts)
    assert [a.num_frames for a in arts] == [1, 8, 8, 8, 8]  # chunks of (1, then 2, 2, ...) latent frames
    assert max(held) <= 3  # the window's chunks and the one leaving it, not the whole video
    assert "video" not in outs["s"].artifacts  # a session's frames went to its client, chunk by chunk


def test_prompts_and_flushes_reach_the_next_steps(pipeline):
    chunks = _Chunks()
    engine = _engine(pipeline, chunks)
    engine.add_request(_session("plain", chunks=3))
    engine.add_request(_session("changed", chunks=3))
    sent = False

    def steer():
        nonlocal sent
        req = engine.scheduler.running.get("changed")
        if not sent and req is not None and req.loop is not None and req.loop.chunk == 1:
            engine.send("changed", TextPart(text="a blue square moving left"))
            engine.send("changed", Flush())  # make chunk 1 again with it, not chunk 2
            sent = True

    _run(engine, steer)
    plain = [a for _, a in chunks.by_request["plain"]]
    changed = [a for _, a in chunks.by_request["changed"]]
    assert [a.prompt for a in changed] == [None, "a blue square moving left", "a blue square moving left"]
    assert torch.equal(plain[0].frames, changed[0].frames)  # before the prompt changed: the same video
    assert not torch.equal(plain[1].frames, changed[1].frames)  # chunk 1 was made again with the new prompt
    with pytest.raises(UnknownRequest, match="live session"):
        engine.send("changed", TextPart(text="too late"))


def test_a_paced_session_waits_for_playback_while_other_work_runs(pipeline):
    chunks = _Chunks()
    engine = _engine(pipeline, chunks)
    engine.add_request(_session("paced", chunks=4, fps=2, realtime=True))  # chunk 1 = 8 frames = 4 s of video
    engine.add_request(OmniRequest(task=TaskType.T2V, request_id="clip", inputs=[TextPart(text="a green triangle")],
                                   outputs=OutputSpec(modalities=[Modality.LATENT]),
                                   diffusion=DiffusionParams(height=32, width=64, num_frames=5, steps=2, seed=2)))
    finished = {}

    def note():
        for rid in ("clip", "paced"):
            if rid not in finished and rid not in engine.scheduler.running:
                finished[rid] = time.perf_counter()

    _run(engine, note)
    times = [t for t, _ in chunks.by_request["paced"]]
    frames = [a.num_frames for _, a in chunks.by_request["paced"]]
    # lead 1: chunk k starts once chunks < k - 1 have played (1 frame, then 8, at 2 fps)
    assert times[3] - times[0] >= sum(frames[:2]) / 2 - 0.05
    assert finished["clip"] < times[3]  # the other request ran while the session waited
