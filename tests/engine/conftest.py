import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="session")
def wan_pipeline(wan_t2v_dir):
    return load_pipeline(wan_t2v_dir, OPTS)[1]


@pytest.fixture
def make_engine(wan_pipeline):
    def make(events=None, **config):
        policy = SchedulingPolicy(**{k: config.pop(k) for k in list(config) if k in SchedulingPolicy.__dataclass_fields__})
        return Engine(wan_pipeline, EngineConfig(policy=policy, **config), event_sink=events.append if events is not None else None)

    return make


def req(seed=0, steps=4, rid=None, size=32, frames=5, **kw):
    extra = {"request_id": rid} if rid else {}
    extra.update({k: kw.pop(k) for k in ("priority", "deadline_s") if k in kw})
    outputs = kw.pop("outputs", OutputSpec(return_latents=True))
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text=f"clip {seed}")], outputs=outputs,
                       diffusion=DiffusionParams(seed=seed, steps=steps, height=size, width=size, num_frames=frames, **kw), **extra)


def run_all(engine):
    outs = {}
    order = []
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
                order.append(out.request_id)
    return outs, order
