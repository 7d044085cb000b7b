"""Bad FAR requests are ValueErrors at admission naming the field and what to pass instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.engine import Engine
from omniloop.engine.errors import RequestRejected
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, TaskType, TextPart, VideoPart


@pytest.fixture(scope="module")
def engine(far_dir):
    return Engine(load_pipeline(far_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1])


def _req(task=TaskType.T2V, inputs=(), node_params=None, **params):
    params = {"height": 32, "width": 64, "num_frames": 17, "steps": 1, **params}
    return OmniRequest(task=task, inputs=[TextPart(text="a circle"), *inputs], diffusion=DiffusionParams(**params),
                       node_params=node_params or {})


@pytest.mark.parametrize("request_, message", [
    (_req(height=48), "diffusion.height=48 must be a multiple of 32"),
    (_req(num_frames=16), "num_frames=16 must be 4k\\+1; pass 13 or 17"),
    (_req(node_params={"rollout": {"chunk_partition": [1, 4]}}), "each chunk must be 1..2 latent frames"),
    (_req(node_params={"rollout": {"chunk_partition": [1, 2]}}), "sums to 3, but the video has 5 latent frames"),
    (_req(node_params={"rollout": {"chunk_size": 2}}), "chunk_size"),
    (_req(TaskType.I2V), "task i2v needs an image"),
    (_req(TaskType.V2V), "task v2v needs a video"),
    (_req(TaskType.V2V, [VideoPart(data=np.zeros((4, 32, 64, 3), np.uint8))]), "inputs video has 4 frames; pass 4k\\+1"),
    (_req(TaskType.V2V, [VideoPart(data=np.zeros((17, 32, 64, 3), np.uint8))]), "more frames to make than"),
    (_req(TaskType.V2V, [VideoPart(data=np.zeros((5, 16, 64, 3), np.uint8))]), "pass frames of the requested size"),
    (_req(TaskType.I2V, [ImagePart(data=np.zeros((32, 64, 3), np.uint8))],
          node_params={"rollout": {"first_chunk_guidance_scale": 3.0}}),
     r"first_chunk_guidance_scale=3.0: no loop of this 'i2v' request makes a chunk from the prompt alone"),
    (_req(TaskType.I2V, [ImagePart(data=np.zeros((32, 64, 3), np.uint8))], node_params={"rollout": {"first_chunk_steps": 4}}),
     r"first_chunk_steps=4: no loop .* use steps, or drop first_chunk_steps"),
])
def test_bad_requests_are_refused_with_the_fix(engine, request_, message):
    with pytest.raises(RequestRejected, match=message):
        engine.add_request(request_)
    assert not engine.has_unfinished()
