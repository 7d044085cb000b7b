"""ComfyUI's samplers on Stable Audio's v-prediction model over EDM-style sigmas: our comfy_v_euler /
comfy_v_dpmpp_2m / comfy_v_dpmpp_2m_sde(_gpu) / comfy_v_dpmpp_3m_sde(_gpu) driven as the denoise loop
drives them (start scaled by ``init_noise_sigma``, model input by ``scale_model_input``, the model
conditioned on the state's timestep) equal ComfyUI's own ``sample_*`` functions behind its
``V_PREDICTION`` / ``ModelSamplingContinuousV`` wrapper, and our simple / normal / sgm_uniform /
karras / exponential sigmas equal its schedulers' (golden/comfy_v_samplers.json, made by
scripts/comfy_samplers_golden.py from a ComfyUI checkout: golden/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omniloop.pipeline.samplers import COMFY_V_SAMPLERS, build_sampler
from omniloop.pipeline.samplers.base import SchedulerConfigError
from omniloop.pipeline.samplers.comfy_v_prediction import V_SCHEDULERS, comfy_v_sigmas

TABLE = json.loads((Path(__file__).parent / "golden" / "comfy_v_samplers.json").read_text())
SETTINGS = TABLE["sampling_settings"]


def _sampler(case):
    return build_sampler(COMFY_V_SAMPLERS[case["sampler"]], {**SETTINGS, "scheduler": case["scheduler"],
                                                              **case["options"]})


def test_the_table_covers_every_sampler_and_scheduler():
    assert {(c["sampler"], c["scheduler"]) for c in TABLE["cases"]} == {(s, k) for s in COMFY_V_SAMPLERS
                                                                        for k in V_SCHEDULERS}
    # normal / sgm_uniform start 2.6e-5 below sigma_max (atan / tan): ComfyUI scales their start by sigma_0
    assert {c["scheduler"] for c in TABLE["cases"] if not c["max_denoise"]} == {"normal", "sgm_uniform"}


@pytest.mark.parametrize("case", TABLE["schedules"], ids=lambda c: f"{c['scheduler']}-{c['steps']}")
def test_schedule_equals_comfyuis(case):
    ours = comfy_v_sigmas(case["scheduler"], case["steps"], SETTINGS["sigma_min"], SETTINGS["sigma_max"])
    assert torch.equal(ours, torch.tensor(case["sigmas"], dtype=torch.float32))


@pytest.mark.parametrize("case", TABLE["cases"], ids=lambda c: f"{c['sampler']}-{c['scheduler']}-{c['steps']}-"
                         f"eta{c['options'].get('eta', '')}")
def test_sampler_equals_comfyuis(case):
    """The schedule and the model's timesteps, then the whole run from the same start and seed: bit for bit."""
    sampler = _sampler(case)
    state = sampler.init_state(case["steps"], seed=case["seed"])
    assert torch.equal(state.sigmas, torch.tensor(case["sigmas"], dtype=torch.float32))
    assert torch.equal(state.timesteps, torch.tensor(case["timesteps"], dtype=torch.float32))
    x = torch.tensor(case["x_init"]) * sampler.init_noise_sigma  # the loop's start from noise
    while not state.done:
        v = 0.5 * sampler.scale_model_input(state, x) - state.timestep  # the toy DiT of the table
        x = sampler.step(state, v, x)
    assert torch.equal(x, torch.tensor(case["x_final"], dtype=torch.float32)), (x - torch.tensor(case["x_final"])).abs().max()


def test_the_compiler_maps_onto_these_samplers_and_schedulers():
    from omniloop.workflows import compiler

    assert dict(compiler.COMFY_V_SAMPLERS) == COMFY_V_SAMPLERS and compiler.V_SCHEDULERS == V_SCHEDULERS


def test_bad_scheduler_and_given_sigmas_are_refused():
    with pytest.raises(SchedulerConfigError, match="scheduler='beta': pass one of"):
        build_sampler("comfy_v_euler", {"scheduler": "beta"})
    with pytest.raises(ValueError, match="drop shift, sigmas and mu"):
        build_sampler("comfy_v_dpmpp_2m", {}).init_state(4, sigmas=[0.9, 0.5, 0.2, 0.1])
