"""Bad input: a ValueError naming the field and what to pass, before any work starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, TaskType, TextPart


@pytest.fixture(scope="module")
def t2v(wan_t2v_dir):
    return VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def i2v(wan_i2v_dir):
    return VideoGenerator.from_pretrained(wan_i2v_dir, device="cpu", dtype="float32")


def _t2v(**params):
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a cat")], diffusion=DiffusionParams(**params))


@pytest.mark.parametrize("field,value,hint", [("height", 100, "96 or 112"), ("width", 40, "32 or 48")])
def test_size_not_multiple_of_16(t2v, field, value, hint):
    with pytest.raises(ValueError, match=rf"diffusion\.{field}={value} must be a multiple of 16; pass {hint}"):
        t2v.generate(_t2v(**{field: value, "num_frames": 5, "height": 32, "width": 32} | {field: value}))


def test_num_frames_not_4k_plus_1(t2v):
    with pytest.raises(ValueError, match=r"diffusion\.num_frames=10 must be 4k\+1; pass 9 or 13"):
        t2v.generate(_t2v(num_frames=10, height=32, width=32))


def test_steps_below_one():
    with pytest.raises(ValidationError, match=r"steps\n  Input should be greater than or equal to 1"):
        DiffusionParams(steps=0)


def test_task_the_model_does_not_declare(t2v):
    req = OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="a drum")])
    with pytest.raises(ValueError, match=r"task 't2a' is not served by 'wan2.1-t2v'; pass one of \['t2i', 't2v', 'v2v'\]"):
        t2v.generate(req)


def test_unknown_task_name_lists_accepted_values():
    # the one "unknown task" message (request.tasks.unknown_task): the API, the CLI and OmniRequest say it
    with pytest.raises(ValidationError, match=r"unknown task 'txt2vid'; pass one of 't2v', 'i2v'"):
        OmniRequest(task="txt2vid")


def test_i2v_without_image(i2v):
    req = OmniRequest(task=TaskType.I2V, inputs=[TextPart(text="a cat")], diffusion=DiffusionParams(height=32, width=32, num_frames=5))
    with pytest.raises(ValueError, match=r"task i2v needs an image: add ImagePart\(role='first_frame'"):
        i2v.generate(req)


def test_unreadable_image(i2v, tmp_path):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not a png")
    req = OmniRequest(task=TaskType.I2V, inputs=[TextPart(text="a cat"), ImagePart(path=str(bad))],
                      diffusion=DiffusionParams(height=32, width=32, num_frames=5))
    with pytest.raises(ValueError, match=r"cannot read image .*not_an_image\.png"):
        i2v.generate(req)
    missing = req.model_copy(update={"inputs": [TextPart(text="a cat"), ImagePart(path=str(tmp_path / "nope.png"))]})
    with pytest.raises(ValueError, match=r"cannot read image .*nope\.png"):
        i2v.generate(missing)


def test_unknown_sampler_and_generation_param(t2v):
    with pytest.raises(ValueError, match=r"diffusion.sampler 'ddim' is not offered by this model; pass one of \['comfy_dpmpp_2m', 'comfy_dpmpp_2m_sde', 'comfy_dpmpp_2m_sde_gpu', 'comfy_dpmpp_2m_sde_heun', 'comfy_dpmpp_2m_sde_heun_gpu', 'comfy_dpmpp_3m_sde', 'comfy_dpmpp_3m_sde_gpu', 'comfy_dpmpp_sde', 'comfy_dpmpp_sde_gpu', 'comfy_euler_ancestral', 'comfy_res_multistep', 'comfy_res_multistep_ancestral', 'comfy_uni_pc', 'comfy_uni_pc_bh2', 'flow_euler', 'flow_sde', 'flow_unipc'\]"):
        t2v.generate(_t2v(sampler="ddim", height=32, width=32, num_frames=5))
    with pytest.raises(ValueError, match=r"unknown generation parameter\(s\) \['guidence_scale'\]"):
        t2v.generate_video("a cat", guidence_scale=3.0)


def test_deploy_limits(t2v):
    with pytest.raises(ValueError, match=r"^diffusion.steps: 500 steps exceed this deployment's limit of 100 \(limits.max_steps\)"):
        t2v.generate(_t2v(steps=500, height=32, width=32, num_frames=5))


def test_bad_request_leaves_generator_usable(t2v):
    with pytest.raises(ValueError):
        t2v.generate(_t2v(num_frames=10))
    out = t2v.generate(_t2v(steps=2, height=32, width=32, num_frames=5, seed=1))
    assert out.status.value == "completed"


def test_layout_errors_name_what_is_missing(tmp_path, wan_t2v_dir):
    import shutil

    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    import torch

    opts = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="missing model_index.json"):
        load_pipeline(tmp_path, opts)
    broken = tmp_path / "broken"
    shutil.copytree(wan_t2v_dir, broken)
    shutil.rmtree(broken / "vae")
    shutil.rmtree(broken / "tokenizer")
    with pytest.raises(ValueError, match=r"incomplete; missing: vae/ \(WanVAE for component 'vae'\), tokenizer/"):
        load_pipeline(broken, opts)
    with pytest.raises(FileNotFoundError, match="neither a directory nor a built-in model name"):
        load_pipeline(tmp_path / "nowhere", opts)


def test_incompatible_scheduler_config_fails_at_load(tmp_path, wan_t2v_dir):
    import json
    import shutil

    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.pipeline.samplers import SchedulerConfigError
    import torch

    broken = tmp_path / "karras"
    shutil.copytree(wan_t2v_dir, broken)
    cfg_path = broken / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["use_karras_sigmas"] = True
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(SchedulerConfigError, match="use_karras_sigmas"):
        load_pipeline(broken, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))


def test_sizes_the_model_cannot_serve_name_the_cap(t2v):
    # the tiny DiT's RoPE table covers 32 tokens per axis: 32 x patch 2 x VAE 8 = 512 pixels
    with pytest.raises(ValueError, match=r"^diffusion.width=1024 is more than this model serves \(at most 512: its "
                                         r"transformer's RoPE table covers 32 tokens per axis, rope_max_seq_len\); "
                                         r"pass 512 or less$"):
        t2v.generate(_t2v(height=32, width=1024, num_frames=5))
