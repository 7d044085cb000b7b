"""Cosmos3 bad input: each a clear error at submission naming the field (nothing runs)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, RequestRejected
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import (
    ActionPart, DiffusionParams, ImagePart, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart,
    VideoPart,
)
from tests.models.cosmos3.checkpoint import save_pipeline

OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)
SMALL = DiffusionParams(height=64, width=64, num_frames=9, steps=2)


@pytest.fixture(scope="module")
def no_towers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cosmos3_plain")
    save_pipeline(folder, sound=False, action=False)
    return load_pipeline(folder, OPTS)[1]


def _img():
    import numpy as np
    return ImagePart(data=np.zeros((64, 96, 3), dtype=np.uint8))


def _req(task, *parts, diffusion=SMALL, modalities=None, **denoise):
    return OmniRequest(task=task, inputs=[TextPart(text="a cube"), *parts], diffusion=diffusion,
                       outputs=OutputSpec(modalities=modalities), node_params={"denoise": denoise} if denoise else {})


def _rejects(pipeline, request, match):
    engine = Engine(pipeline)
    with pytest.raises(RequestRejected, match=match):
        engine.add_request(request)
    assert not engine.has_unfinished()


def test_tasks_the_checkpoint_cannot_do(no_towers):
    _rejects(no_towers, _req(TaskType.T2VS), "task 't2vs' needs a sound tower.*sound_gen=false.*pass task 't2v'")
    actions = ActionPart(values=[[0.0] * 10] * 4)
    _rejects(no_towers, _req(TaskType.A2W, _img(), actions, diffusion=DiffusionParams(steps=2), domain="umi"),
             "needs an action tower")
    _rejects(no_towers, _req(TaskType.V2W, _img(), modalities=[Modality.VIDEO, Modality.ACTION], domain="umi"),
             "needs an action tower")


def test_action_inputs(cosmos3_pipeline):
    actions = ActionPart(values=[[0.0] * 10] * 4)
    one = DiffusionParams(steps=2)
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), actions, diffusion=one, domain="mars_rover"),
             r"node_params\['denoise'\].domain='mars_rover' is not a known embodiment domain; pass one of")
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), actions, diffusion=one),
             r"needs an embodiment: pass node_params\['denoise'\].domain")
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), ActionPart(values=[[0.0] * 7] * 4), diffusion=one, domain="umi"),
             r"rows have 7 values but domain 'umi' takes 10")
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), diffusion=one, domain="umi"), "needs actions")
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), ActionPart(values=[[0.0] * 10] * 3), diffusion=one, domain="umi"),
             r"ActionPart's rows \+ 1=4 must be 4k\+1 frames")
    _rejects(cosmos3_pipeline, _req(TaskType.A2W, _img(), actions, diffusion=one, domain="hand_pose"),
             "57-wide actions but this checkpoint's action_dim is 12")
    _rejects(cosmos3_pipeline, _req(TaskType.V2W, modalities=[Modality.ACTION], domain="umi"), "needs the video")


def test_generation_inputs(cosmos3_pipeline):
    _rejects(cosmos3_pipeline, _req(TaskType.I2V), "task 'i2v' needs an image")
    _rejects(cosmos3_pipeline, _req(TaskType.V2W), "task 'v2w' continues a video")
    _rejects(cosmos3_pipeline, _req(TaskType.T2V, diffusion=DiffusionParams(height=72, width=64)),
             r"diffusion.height=72 must be a multiple of 16; pass 64 or 80")
    _rejects(cosmos3_pipeline, _req(TaskType.T2V, diffusion=DiffusionParams(num_frames=8)), "must be 4k\\+1")
    _rejects(cosmos3_pipeline, _req(TaskType.T2I, diffusion=DiffusionParams(num_frames=9)), "makes one image")
    video = VideoPart(data=torch.zeros(9, 64, 64, 3, dtype=torch.uint8))
    _rejects(cosmos3_pipeline, _req(TaskType.V2W, video, condition_frames=[0, 5]), "condition_frames=\\[0, 5\\]")
    _rejects(cosmos3_pipeline, _req(TaskType.T2V, bogus=1), r"node_params\['denoise'\].bogus: Extra inputs")
    _rejects(cosmos3_pipeline, _req(TaskType.T2V, modalities=[Modality.AUDIO]), "makes no sound; pass task 't2vs'")


def test_reason_limits(cosmos3_pipeline, cosmos3_dir):
    long = OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="hello world " * 40)],
                       sampling=SamplingParams(max_tokens=32768))
    _rejects(cosmos3_pipeline, long, r"exceeds the model's context of 32768 tokens; pass sampling.max_tokens <= ")
    tiny_pool = load_pipeline(cosmos3_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32,
                                                       kv_cache_gb=2 * 16 * 2 * 2 * 16 * 4 / 2**30))[1]  # 2 blocks
    _rejects(tiny_pool, OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="hello")],
                                    sampling=SamplingParams(max_tokens=40)),
             "KV blocks but the text KV pool holds 2.*kv_cache_gb")
    _rejects(cosmos3_pipeline, OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="hi"), _img()]),
             "vision tower")
