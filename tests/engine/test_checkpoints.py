"""Crash checkpoints of denoise loops (engine/checkpoints.py): a request whose engine died after
k steps, submitted again to a new engine with its last checkpoint, ends with exactly the
latents of an uninterrupted run (``torch.equal`` on CPU), for the multistep sampler (UniPC:
its history is part of the checkpoint) and the Euler one; a checkpoint that does not fit
the request is set aside and the loop runs from its first step."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.checkpoints import CheckpointCadence
from omniloop.pipeline.checkpoint import LoopCheckpoint
from omniloop.request import OutputSpec
from tests.engine.conftest import req, run_all


class MemoryCheckpoints:
    """A LoopCheckpoints store in memory; ``resumable`` plays the restart's loaded files."""

    def __init__(self, cadence: CheckpointCadence, resumable: dict[str, LoopCheckpoint] | None = None) -> None:
        self.cadence = cadence
        self.saved: dict[str, list[LoopCheckpoint]] = {}
        self.resumable = dict(resumable or {})
        self.reports: list[tuple[str, str, int | None, str | None]] = []
        self.discarded: list[str] = []

    def wants(self, request_id: str) -> bool:
        return request_id != "not-a-job"

    def save(self, request_id: str, checkpoint: LoopCheckpoint) -> None:
        self.saved.setdefault(request_id, []).append(checkpoint)

    def resume_point(self, request_id: str, node: str) -> LoopCheckpoint | None:
        ck = self.resumable.get(request_id)
        return self.resumable.pop(request_id) if ck is not None and ck.node == node else None

    def resumed(self, request_id: str, node: str, step: int | None, why: str | None) -> None:
        self.reports.append((request_id, node, step, why))

    def discard(self, request_id: str) -> None:
        self.discarded.append(request_id)


def _run(engine, request):
    engine.add_request(request)
    outs, _ = run_all(engine)
    return outs[request.request_id]


def _latents(out):
    return out.artifacts["latents"].latents


@pytest.mark.parametrize("sampler", ["flow_unipc", "flow_euler"])
def test_resumed_from_any_step_equals_the_uninterrupted_run(make_engine, sampler):
    request = req(3, steps=6, rid="job", sampler=sampler)
    whole = make_engine()
    store = MemoryCheckpoints(CheckpointCadence(every_steps=1, every_s=None))
    whole.checkpoints = store
    expected = _latents(_run(whole, request))
    saved = store.saved["job"]
    assert [c.steps_done for c in saved] == [1, 2, 3, 4, 5] and store.discarded == ["job"]
    assert all(c.node == "denoise" and c.steps_target == 6 for c in saved)
    if sampler == "flow_unipc":  # the multistep history is in it
        assert "sampler/video/model_outputs/1" in saved[2].tensors and saved[2].values["sampler/video/step_index"] == 3
    for ck in (saved[0], saved[3], saved[4]):
        again = make_engine()
        resumed = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=None), {"job": ck})
        again.checkpoints = resumed
        out = _run(again, request)
        assert torch.equal(_latents(out), expected), ck.steps_done
        assert resumed.reports == [("job", "denoise", ck.steps_done, None)]
        assert out.metrics.steps == 6  # the loop's steps, counted from 0 as a whole run does


def test_a_checkpoint_that_does_not_fit_runs_the_loop_from_its_first_step(make_engine):
    first = make_engine()
    store = MemoryCheckpoints(CheckpointCadence(every_steps=2, every_s=None))
    first.checkpoints = store
    _run(first, req(3, steps=6, rid="job"))
    ck = store.saved["job"][0]
    other = req(3, steps=4, rid="job", size=48)  # another job's shape and steps
    expected = _latents(_run(make_engine(), other))
    again = make_engine()
    resumed = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=None), {"job": ck})
    again.checkpoints = resumed
    assert torch.equal(_latents(_run(again, other)), expected)
    ((_, node, step, why),) = resumed.reports
    assert (node, step) == ("denoise", None)
    assert why == "its checkpoint does not fit: checkpoint of node 'denoise' at step 2/6 does not fit node 'denoise' of 4 steps"


def test_trajectory_and_seconds_cadence(make_engine):
    request = req(5, steps=4, rid="job", outputs=OutputSpec(return_latents=True, return_trajectory=True))
    store = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=1e-9))  # every step, by time
    engine = make_engine()
    engine.checkpoints = store
    whole = _run(engine, request)
    ck = store.saved["job"][1]
    assert ck.steps_done == 2 and ck.values["trajectory#len"] == 2
    again = make_engine()
    again.checkpoints = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=None), {"job": ck})
    out = _run(again, request)
    assert torch.equal(out.artifacts["trajectory"].tensor, whole.artifacts["trajectory"].tensor)
    assert torch.equal(_latents(out), _latents(whole))
    quiet = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=3600.0))  # a short job writes none
    engine = make_engine()
    engine.checkpoints = quiet
    _run(engine, req(5, steps=4, rid="short"))
    assert quiet.saved == {} and quiet.discarded == ["short"]
    every = MemoryCheckpoints(CheckpointCadence(every_steps=1, every_s=None))
    engine = make_engine()
    engine.checkpoints = every
    _run(engine, req(5, steps=4, rid="not-a-job"))  # the store does not want it: no checkpoint is even taken
    assert every.saved == {}


def test_a_chunk_rollout_resumes_from_its_made_chunks_and_equals_the_uninterrupted_run(far_dir):
    """FAR (causal chunks, tiny random checkpoint): a checkpoint inside a chunk and one at a
    chunk boundary; the made chunks' K/V and decoded frames are rebuilt by running their
    boundaries again, and the video and latents equal the uninterrupted run's."""
    from omniloop.engine import Engine, EngineConfig
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

    pipeline = load_pipeline(far_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    request = OmniRequest(task=TaskType.T2V, request_id="job", inputs=[TextPart(text="a circle")],
                          outputs=OutputSpec(return_latents=True),
                          diffusion=DiffusionParams(seed=4, steps=2, height=32, width=64, num_frames=17))
    whole = Engine(pipeline, EngineConfig())
    store = MemoryCheckpoints(CheckpointCadence(every_steps=1, every_s=None))
    whole.checkpoints = store
    expected = _run(whole, request)
    saved = store.saved["job"]
    inside = next(c for c in saved if c.values["chunk"] == 1 and c.values.get("inner#steps") == 1)
    boundary = next(c for c in saved if c.values["chunk"] == 1 and c.values["boundary"])
    assert inside.steps_done == 4 and boundary.steps_done == 5 and "clean/1" in boundary.tensors
    for ck in (inside, boundary, saved[-1]):
        again = Engine(pipeline, EngineConfig())
        resumed = MemoryCheckpoints(CheckpointCadence(every_steps=None, every_s=None), {"job": ck})
        again.checkpoints = resumed
        out = _run(again, request)
        assert resumed.reports == [("job", "rollout", ck.steps_done, None)], ck.values
        assert torch.equal(_latents(out), _latents(expected))
        assert torch.equal(out.video.frames, expected.video.frames)
