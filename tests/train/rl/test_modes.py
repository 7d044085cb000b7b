"""Library mode and engine-client mode give the same trajectories for the same seeds and weights:
the trainer's in-process Engine and seeded OmniRequests POSTed to a live ``omniloop serve``
(uvicorn on 127.0.0.1, /v1/rollouts) over one checkpoint. Both run one request per step
(max_batch=1): a forward's numbers depend on its batch-mates (see test_consistency's C2), and the
server batches whatever arrives together."""

from __future__ import annotations

import httpx
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from omniloop.train.rl import AsyncEngineClient, HttpClient, LibraryClient, PromptList, RolloutContext, group_rollout
from omniloop.train.rl.rollout import RolloutSpec
from omniloop.train.rl.trajectory import TrajectoryStatus
from tests.serve.conftest import live_server

SPEC = RolloutSpec(steps=3, height=32, width=32, num_frames=5, decode=True)
FIELDS = ("latents", "start", "timesteps", "sigmas", "log_probs", "stochastic", "final_latents", "video")


@pytest.fixture(scope="module")
def server(wan_t2v_dir):
    limits = {"max_steps": 8, "max_frames": 9, "max_pixels": 32 * 32, "max_images": 4}
    with live_server(wan_t2v_dir, limits=limits, max_batch=1) as live:
        yield live


def _ctx(client):
    return RolloutContext(client=client, prompts=PromptList(["a red circle moving right", "a blue square moving left"]),
                          group_size=2, groups=2, spec=SPEC, seed=3)


def test_library_and_http_rollouts_are_identical(wan_t2v_dir, server):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    try:
        library = group_rollout(_ctx(LibraryClient.of(gen.pipeline, max_batch=1)))
    finally:
        gen.close()
    remote = group_rollout(_ctx(HttpClient(server.url)))
    in_process = group_rollout(_ctx(AsyncEngineClient(server.engine)))  # the served engine, called in process
    assert len(library) == len(remote) == len(in_process) == 4
    for a, b in [*zip(library, remote), *zip(library, in_process)]:
        assert a.status is b.status is TrajectoryStatus.COMPLETED
        assert a.seed == b.seed and a.prompt == b.prompt and a.group == b.group
        for name in FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x is not None and torch.equal(x, y), name
        assert a.weight_version == b.weight_version
    assert not torch.equal(library[0].final_latents, library[1].final_latents)  # seeds differ within a group


def test_rollouts_endpoint_refuses_bad_input(server):
    bad = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a cat")],
                      diffusion=DiffusionParams(seed=1, sampler="flow_euler", steps=2, height=32, width=32,
                                                num_frames=5),
                      outputs=OutputSpec(return_trajectory=True, return_log_probs=True))
    reply = httpx.post(f"{server.url}/v1/rollouts", json={"requests": [bad.model_dump(mode="json")]}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "diffusion.sampler" in reply.text and "deterministic" in reply.text
    reply = httpx.post(f"{server.url}/v1/rollouts", json={"requests": []}, timeout=60)
    assert reply.status_code == 400 and "requests" in reply.text


def test_rollouts_endpoint_never_reads_server_paths(server, tmp_path):
    from omniloop.request import ImagePart

    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not for clients")
    req = OmniRequest(task=TaskType.I2V, inputs=[TextPart(text="a cat"), ImagePart(path=str(secret))],
                      diffusion=DiffusionParams(seed=1, steps=2, height=32, width=32, num_frames=5))
    reply = httpx.post(f"{server.url}/v1/rollouts", json={"requests": [req.model_dump(mode="json")]}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "path_refused" in reply.text and "requests[0].inputs[1].path" in reply.text
