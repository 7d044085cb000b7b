"""ComfyUI's uni_pc / uni_pc_bh2 (our comfy_uni_pc samplers) equal ComfyUI's own sample_unipc
as its KSampler drives it on a flow model (golden/comfy_unipc.json, made by
scripts/comfy_unipc_golden.py from a ComfyUI checkout: golden/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler
from omniloop.workflows.schedules import ksampler_sigmas

GOLDEN = json.loads((Path(__file__).parent / "golden" / "comfy_unipc.json").read_text())["unipc"]
NAMES = {"bh1": "comfy_uni_pc", "bh2": "comfy_uni_pc_bh2"}


def test_the_table_covers_both_variants_and_both_schedules():
    assert {(c["variant"], c["ksampler"]) for c in GOLDEN} == {(v, k) for v in NAMES for k in (False, True)}
    assert {c["steps"] for c in GOLDEN} >= {1, 2, 3, 4, 10}


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['variant']}-shift{c['shift']:g}-{c['steps']}"
                         f"{'-ksampler' if c['ksampler'] else ''}")
def test_comfy_unipc_equals_comfyui_sample_unipc(case):
    """Our sigmas (KSampler's: one more step, the penultimate dropped) bit for bit, then the
    sampler over them, driven by the denoise loop's calls (scale_model_input, model, step), on
    the toy flow model v = 0.5 x - sigma."""
    sampler_name = "uni_pc" if case["variant"] == "bh1" else "uni_pc_bh2"
    sigmas = ksampler_sigmas("simple", case["steps"], case["shift"], sampler_name) if case["ksampler"] else \
        ksampler_sigmas("simple", case["steps"], case["shift"])
    assert sigmas == case["sigmas"]
    sampler = build_sampler(NAMES[case["variant"]], {"shift": 1.0})
    state = sampler.init_state(len(sigmas) - 1, sigmas=sigmas[:-1], shift=1.0)
    x = torch.tensor([case["x_init"]], dtype=torch.float32)  # [1, 6]
    for _ in range(len(sigmas) - 1):
        model_input = sampler.scale_model_input(state, x)
        x = sampler.step(state, 0.5 * model_input - state.sigma, x)
    assert state.done
    torch.testing.assert_close(x[0], torch.tensor(case["x_final"]), rtol=0, atol=1e-6)


def test_comfy_unipc_differs_from_diffusers_unipc_and_refuses_bad_input():
    """The reason it exists: diffusers' flow UniPC (flow_unipc) takes other steps."""
    case = next(c for c in GOLDEN if c["steps"] == 4 and not c["ksampler"] and c["variant"] == "bh2")
    ours = build_sampler("flow_unipc", {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                                        "flow_shift": 1.0, "solver_type": "bh2"})
    state = ours.init_state(4, sigmas=case["sigmas"][:-1], shift=1.0)
    x = torch.tensor([case["x_init"]])
    for _ in range(4):
        x = ours.step(state, 0.5 * x - state.sigma, x)
    assert (x[0] - torch.tensor(case["x_final"])).abs().max() > 1e-3
    with pytest.raises(ValueError, match="unknown ComfyUniPC config keys"):
        build_sampler("comfy_uni_pc", {"solver_order": 2})


def test_a_ksampler_uni_pc_template_compiles_to_comfyuis_schedule_and_sampler():
    """text_to_video_wan (KSampler uni_pc / simple under ModelSamplingSD3): the request runs
    comfy_uni_pc on KSampler's sigmas (steps + 1, the penultimate dropped), shift 1."""
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("text_to_video_wan"))
    ksampler = next(n["inputs"] for n in api.values() if n["class_type"] == "KSampler")
    shift = next(n["inputs"]["shift"] for n in api.values() if n["class_type"] == "ModelSamplingSD3")
    assert (ksampler["sampler_name"], ksampler["scheduler"]) == ("uni_pc", "simple")
    (generation,) = compile_workflow(api, template_models()).generations
    params = generation.request.diffusion
    assert params.sampler == "comfy_uni_pc" and params.shift == 1.0
    assert params.sigmas == ksampler_sigmas("simple", ksampler["steps"], shift, "uni_pc")[:-1]
    assert len(params.sigmas) == ksampler["steps"]


def test_a_ksampler_schedule_that_would_repeat_a_sigma_is_a_deviation():
    """1000 uni_pc steps: KSampler's 1001-step simple schedule repeats a training sigma (ComfyUI
    then divides by h = 0); the 1000-step schedule runs, reported."""
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("text_to_video_wan"))
    next(n for n in api.values() if n["class_type"] == "KSampler")["inputs"]["steps"] = 1000
    result = compile_workflow(api, template_models())
    assert any("repeats a sigma" in d.message for d in result.deviations)
    assert len(result.generations[0].request.diffusion.sigmas) == 1000


def test_a_run_from_given_latents_is_comfyuis_run_over_the_rest_of_the_schedule():
    """A loop from given latents starts mid-schedule (step_index = start): the sampler runs the
    remaining sigmas as a fresh ComfyUI run over them (what its KSampler does with denoise < 1)."""
    case = next(c for c in GOLDEN if c["steps"] == 10 and not c["ksampler"] and c["variant"] == "bh1")
    sampler = build_sampler("comfy_uni_pc", {})
    sigmas, start = case["sigmas"], 4

    def run(state, x):
        while not state.done:
            x = sampler.step(state, 0.5 * sampler.scale_model_input(state, x) - state.sigma, x)
        return x

    x0 = torch.tensor([case["x_init"]])
    late = sampler.init_state(10, sigmas=sigmas[:-1], shift=1.0)
    late.step_index = start
    fresh = sampler.init_state(10 - start, sigmas=sigmas[start:-1], shift=1.0)
    assert torch.equal(run(late, x0), run(fresh, x0))
