"""Sigma schedules and the Euler update equal ComfyUI's (golden tables made by running
ComfyUI's own functions: golden/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omniloop.pipeline.samplers.flow_euler import FlowEulerSampler
from omniloop.workflows.schedules import SCHEDULES, flow_schedule

GOLDEN = json.loads((Path(__file__).parent / "golden" / "comfy_flow_schedules.json").read_text())
CASES = [c for c in GOLDEN["schedules"] if c["scheduler"] in SCHEDULES]


def test_the_table_covers_every_schedule_we_run():
    # the others (karras, exponential, ...) have their table in comfy_samplers.json (test_comfy_samplers.py)
    more = {c["scheduler"] for c in json.loads((Path(__file__).parent / "golden" / "comfy_samplers.json")
                                               .read_text())["schedules"]}
    assert {c["scheduler"] for c in CASES} | more == set(SCHEDULES) and len(CASES) == 80


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['scheduler']}-shift{c['shift']:g}-{c['steps']}")
def test_schedule_equals_comfyui(case):
    assert flow_schedule(case["scheduler"], case["steps"], case["shift"]) == case["sigmas"]  # bit for bit


def test_beta_quantiles_equal_scipys():
    """The Beta(0.6, 0.6) inverse CDF behind ``beta`` (scipy, ComfyUI's, is a test oracle only)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from omniloop.workflows.schedules import beta_ppf

    for q in (0.0, 0.001, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999, 1.0):
        assert beta_ppf(q, 0.6, 0.6) == pytest.approx(float(scipy_stats.beta.ppf(q, 0.6, 0.6)), abs=1e-12)


@pytest.mark.parametrize("case", GOLDEN["euler"], ids=lambda c: f"shift{c['shift']:g}-{c['steps']}")
def test_flow_euler_over_comfy_sigmas_equals_comfyui_sample_euler(case):
    """The workflow's sigmas (shift already applied: the request's shift is 1) through our
    flow_euler sampler reach ComfyUI's sample_euler result on the same toy flow model."""
    sigmas = flow_schedule("simple", case["steps"], case["shift"])
    assert sigmas == case["sigmas"]
    sampler = FlowEulerSampler()
    state = sampler.init_state(len(sigmas) - 1, sigmas=sigmas[:-1], shift=1.0)
    x = torch.tensor(case["x_init"], dtype=torch.float32)
    for i in range(len(sigmas) - 1):
        sigma = state.sigmas[i]
        x = sampler.step(state, 0.5 * x - sigma, x)  # v(x, sigma) = 0.5 x - sigma
    torch.testing.assert_close(x, torch.tensor(case["x_final"]), rtol=0, atol=1e-6)
