"""Sampler parity with diffusers (the test-only oracle), per-request state, and load-time refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler  # noqa: E402

from omniloop.pipeline.samplers import (  # noqa: E402
    FlowEulerSampler,
    FlowUniPCSampler,
    FlowUniPCState,
    SamplerState,
    SchedulerConfigError,
    build_sampler,
    sampler_for_diffusers_class,
)

# Wan2.1 T2V scheduler/scheduler_config.json.
WAN21_UNIPC = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "lower_order_final": True,
    "predict_x0": True,
    "final_sigmas_type": "zero",
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "timestep_spacing": "linspace",
    "use_karras_sigmas": False,
}
# The same checkpoint as diffusers serializes it (every VP-only key present).
WAN21_UNIPC_FULL = {
    **WAN21_UNIPC,
    "_diffusers_version": "0.33.0.dev0",
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_p": None,
    "steps_offset": 0,
    "thresholding": False,
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_dynamic_shifting": False,
    "time_shift_type": "exponential",
}
EULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX_EULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
LTX_EULER = {**EULER, "shift": 2.05, "shift_terminal": 0.1}

SHIFTS = [1.0, 3.0, 5.0, 12.0]
STEPS = [1, 2, 3, 4, 10, 50]
SHAPE = (2, 4, 3, 5)  # [B, C, F, HW]: UniPC's einsum needs a batch and a channel axis
CUSTOM_SIGMAS = [1.0, 0.9, 0.75, 0.5, 0.3, 0.12, 0.05]


# ---------------------------------------------------------------------------- factories


def fake_velocity(sample: torch.Tensor, timestep: torch.Tensor, step: int, dtype=torch.float32) -> torch.Tensor:
    """A deterministic stand-in for the DiT: depends on the sample, the timestep and a per-step seed."""
    noise = torch.randn(sample.shape, generator=torch.Generator().manual_seed(1000 + step))
    t = float(timestep) / 1000
    return (noise - torch.tanh(sample.float()) * (1.2 - t)).to(dtype)


def initial_noise(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def diffusers_scheduler(config: dict, num_steps: int | None, *, sigmas=None, mu=None):
    cls = {"UniPCMultistepScheduler": UniPCMultistepScheduler, "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler}
    scheduler = cls[config["_class_name"]].from_config(config)
    kwargs = {"mu": mu} if mu is not None else {}
    if sigmas is not None:
        if isinstance(scheduler, UniPCMultistepScheduler):
            sigmas = np.array(sigmas, dtype=np.float64)  # diffusers' UniPC needs an array here
        scheduler.set_timesteps(sigmas=sigmas, **kwargs)
    else:
        scheduler.set_timesteps(num_steps, **kwargs)
    scheduler.set_begin_index(0)  # as the pipelines do; index lookup by timestep is a diffusers detail
    return scheduler


def diffusers_trajectory(scheduler, x: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    samples = []
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(fake_velocity(x, t, i, dtype), t, x, return_dict=False)[0]
        samples.append(x)
    return samples


def our_trajectory(sampler, state: SamplerState, x: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    samples = []
    while not state.done:
        x = sampler.step(state, fake_velocity(x, state.timestep, state.step_index, dtype), x)
        samples.append(x)
    return samples


def assert_schedule_equal(state: SamplerState, scheduler) -> None:
    assert state.timesteps.dtype == scheduler.timesteps.dtype
    assert state.sigmas.dtype == scheduler.sigmas.dtype == torch.float32
    torch.testing.assert_close(state.timesteps, scheduler.timesteps.cpu(), rtol=0, atol=1e-6 * 1000)
    torch.testing.assert_close(state.sigmas, scheduler.sigmas.cpu(), rtol=0, atol=1e-6)


def assert_trajectories_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype, f"step {i}: {a.dtype} != {b.dtype}"
        assert torch.isfinite(a).all(), f"step {i} is not finite"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")


def check_parity(sampler, config: dict, num_steps: int, *, shift=None, sigmas=None, mu=None, dtype=torch.float32):
    """Schedule and every intermediate sample equal diffusers built from ``config``."""
    state = sampler.init_state(num_steps, shift=shift, sigmas=sigmas, mu=mu)
    scheduler = diffusers_scheduler(config, num_steps, sigmas=sigmas, mu=mu)
    assert_schedule_equal(state, scheduler)
    x = initial_noise()
    assert_trajectories_equal(our_trajectory(sampler, state, x, dtype), diffusers_trajectory(scheduler, x, dtype))
    return state


# ---------------------------------------------------------------------------- flow_euler parity


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("shift", SHIFTS)
def test_flow_euler_matches_diffusers(shift: float, num_steps: int) -> None:
    config = {**EULER, "shift": shift}
    check_parity(FlowEulerSampler.from_config(config), config, num_steps)


@pytest.mark.parametrize("shift", SHIFTS)
def test_flow_euler_request_shift_acts_like_config_shift(shift: float) -> None:
    sampler = FlowEulerSampler.from_config(EULER)
    check_parity(sampler, {**EULER, "shift": shift}, 10, shift=shift)
    assert sampler.shift == 3.0  # the override is per request


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_euler_custom_sigmas(shift: float) -> None:
    config = {**EULER, "shift": shift}
    check_parity(FlowEulerSampler.from_config(config), config, len(CUSTOM_SIGMAS), sigmas=CUSTOM_SIGMAS)


@pytest.mark.parametrize("num_steps", [2, 4, 30])
def test_flow_euler_shift_terminal(num_steps: int) -> None:
    state = check_parity(FlowEulerSampler.from_config(LTX_EULER), LTX_EULER, num_steps)
    assert state.sigmas[-2].item() == pytest.approx(0.1, abs=1e-6)


@pytest.mark.parametrize(("name", "config"), [("flow_euler", LTX_EULER), ("flow_unipc", {**WAN21_UNIPC, "shift_terminal": 0.1})])
def test_shift_terminal_refuses_a_schedule_ending_at_one(name: str, config: dict) -> None:
    """One step is the schedule [1.0]: diffusers' stretch divides 0 by 0 and samples NaN."""
    with pytest.raises(ValueError, match="at least 2 steps"):
        build_sampler(name, config).init_state(1)


@pytest.mark.parametrize("time_shift_type", ["exponential", "linear"])
@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
def test_flow_euler_dynamic_shifting_with_mu(time_shift_type: str, seq_len: int) -> None:
    config = {**FLUX_EULER, "time_shift_type": time_shift_type}
    sampler = FlowEulerSampler.from_config(config)
    mu = sampler.mu_for_seq_len(seq_len)
    check_parity(sampler, config, 28, mu=mu)
    # Flux passes its own base sigmas alongside mu.
    flux_sigmas = np.linspace(1.0, 1 / 28, 28).tolist()
    check_parity(sampler, config, 28, sigmas=flux_sigmas, mu=mu)


def test_flow_euler_mu_for_seq_len_interpolates_base_and_max_shift() -> None:
    """Flux's calculate_shift: mu is linear in the token count, base_shift at 256, max_shift at 4096."""
    sampler = FlowEulerSampler.from_config(FLUX_EULER)
    assert sampler.mu_for_seq_len(256) == pytest.approx(0.5)
    assert sampler.mu_for_seq_len(4096) == pytest.approx(1.15)
    assert sampler.mu_for_seq_len(2176) == pytest.approx(0.825)


def test_flow_euler_bf16_model_output_returns_bf16_like_diffusers() -> None:
    sampler = FlowEulerSampler.from_config(EULER)
    check_parity(sampler, EULER, 10, dtype=torch.bfloat16)
    state = sampler.init_state(4)
    out = sampler.step(state, torch.ones(SHAPE, dtype=torch.bfloat16), torch.zeros(SHAPE))
    assert out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- flow_unipc parity


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("solver_order", [1, 2, 3])
def test_flow_unipc_matches_diffusers(solver_order: int, shift: float, num_steps: int) -> None:
    config = {**WAN21_UNIPC, "solver_order": solver_order, "flow_shift": shift}
    check_parity(FlowUniPCSampler.from_config(config), config, num_steps)


@pytest.mark.parametrize("num_steps", [1, 2, 50])
def test_flow_unipc_wan21_default_config(num_steps: int) -> None:
    sampler = build_sampler(sampler_for_diffusers_class(WAN21_UNIPC["_class_name"]), WAN21_UNIPC)
    state = check_parity(sampler, WAN21_UNIPC, num_steps)
    assert isinstance(state, FlowUniPCState)
    assert state.timesteps.dtype == torch.int64  # diffusers truncates; the model must see the same
    assert FlowUniPCSampler.from_config(WAN21_UNIPC_FULL) == sampler


@pytest.mark.parametrize("shift", SHIFTS)
def test_flow_unipc_request_shift_replaces_flow_shift(shift: float) -> None:
    sampler = FlowUniPCSampler.from_config(WAN21_UNIPC)
    check_parity(sampler, {**WAN21_UNIPC, "flow_shift": shift}, 10, shift=shift)
    assert sampler.flow_shift == 3.0
    torch.testing.assert_close(sampler.init_state(10).sigmas, FlowUniPCSampler.from_config(WAN21_UNIPC).init_state(10).sigmas)


@pytest.mark.parametrize(
    "overrides",
    [
        {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
        {"solver_type": "bh1", "final_sigmas_type": "sigma_min", "solver_order": 3},
        {"final_sigmas_type": "sigma_min", "solver_order": 3},
        {"disable_corrector": [0, 1, 5]},
        {"solver_order": 3, "disable_corrector": [2]},
        {"lower_order_final": False, "solver_order": 1},
        {"shift_terminal": 0.05, "solver_order": 3},
        {"flow_shift": 5.0, "time_shift_type": "exponential", "num_train_timesteps": 500},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("num_steps", [3, 12])
def test_flow_unipc_options(overrides: dict, num_steps: int) -> None:
    config = {**WAN21_UNIPC, **overrides}
    check_parity(FlowUniPCSampler.from_config(config), config, num_steps)


@pytest.mark.parametrize("solver_order", [1, 2, 3])
@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_flow_unipc_custom_sigmas(solver_order: int, shift: float) -> None:
    config = {**WAN21_UNIPC, "solver_order": solver_order, "flow_shift": shift}
    check_parity(FlowUniPCSampler.from_config(config), config, len(CUSTOM_SIGMAS), sigmas=CUSTOM_SIGMAS)


@pytest.mark.parametrize("time_shift_type", ["exponential", "linear"])
def test_flow_unipc_dynamic_shifting_with_mu(time_shift_type: str) -> None:
    config = {**WAN21_UNIPC, "use_dynamic_shifting": True, "time_shift_type": time_shift_type}
    check_parity(FlowUniPCSampler.from_config(config), config, 20, mu=1.1)


def test_flow_unipc_bf16_model_output_keeps_sample_dtype_like_diffusers() -> None:
    sampler = FlowUniPCSampler.from_config(WAN21_UNIPC)
    check_parity(sampler, WAN21_UNIPC, 10, dtype=torch.bfloat16)
    state = sampler.init_state(4)
    out = sampler.step(state, torch.ones(SHAPE, dtype=torch.bfloat16), torch.zeros(SHAPE))
    assert out.dtype == torch.float32  # UniPC returns the sample's dtype; Euler the model output's


# ---------------------------------------------------------------------------- per-request state


@pytest.mark.parametrize(
    ("name", "config"),
    [("flow_unipc", WAN21_UNIPC), ("flow_unipc", {**WAN21_UNIPC, "solver_order": 3}), ("flow_euler", EULER)],
)
def test_interleaved_requests_share_one_sampler(name: str, config: dict) -> None:
    sampler = build_sampler(name, config)
    requests = [
        {"num_steps": 10, "shift": 3.0, "seed": 0},
        {"num_steps": 7, "shift": 5.0, "seed": 1},
        {"num_steps": 13, "shift": 1.0, "seed": 2},
    ]
    alone = [our_trajectory(sampler, sampler.init_state(r["num_steps"], shift=r["shift"]), initial_noise(r["seed"])) for r in requests]

    states = [sampler.init_state(r["num_steps"], shift=r["shift"]) for r in requests]
    samples = [initial_noise(r["seed"]) for r in requests]
    interleaved: list[list[torch.Tensor]] = [[] for _ in requests]
    while not all(s.done for s in states):
        for k, state in enumerate(states):  # one step of each live request in turn
            if state.done:
                continue
            v = fake_velocity(samples[k], state.timestep, state.step_index)
            samples[k] = sampler.step(state, v, samples[k])
            interleaved[k].append(samples[k])

    for ours, reference in zip(interleaved, alone):
        assert len(ours) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_step_after_done_is_an_error() -> None:
    sampler = FlowUniPCSampler.from_config(WAN21_UNIPC)
    state = sampler.init_state(1)
    x = sampler.step(state, torch.zeros(SHAPE), torch.ones(SHAPE))
    assert state.done
    with pytest.raises(AssertionError, match="after the last"):
        sampler.step(state, torch.zeros(SHAPE), x)


@pytest.mark.parametrize(
    ("name", "config", "kwargs", "message"),
    [
        ("flow_euler", EULER, {"mu": 0.5}, "use_dynamic_shifting"),
        ("flow_euler", FLUX_EULER, {}, "pass mu="),
        ("flow_euler", FLUX_EULER, {"mu": 0.5, "shift": 2.0}, "no effect"),
        ("flow_unipc", WAN21_UNIPC, {"mu": 0.5}, "use_dynamic_shifting"),
        ("flow_unipc", WAN21_UNIPC, {"shift": 0.0}, "shift must be > 0"),
        ("flow_unipc", WAN21_UNIPC, {"sigmas": [1.0, 0.5]}, "exactly num_steps"),
        ("flow_unipc", WAN21_UNIPC, {"sigmas": [1.0, 0.5, 0.5, 0.1]}, "strictly descending"),
        ("flow_euler", EULER, {"sigmas": [1.0, 0.5, 0.2, 0.0]}, "(0, 1]"),
    ],
)
def test_bad_request_arguments(name: str, config: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        build_sampler(name, config).init_state(4, **kwargs)


# ---------------------------------------------------------------------------- refused configs


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"use_karras_sigmas": True}, ["use_karras_sigmas", "set use_karras_sigmas=false"]),
        ({"use_exponential_sigmas": True}, ["use_exponential_sigmas", "set use_exponential_sigmas=false"]),
        ({"use_beta_sigmas": True}, ["use_beta_sigmas", "set use_beta_sigmas=false"]),
        ({"stochastic_sampling": True}, ["stochastic_sampling", "set stochastic_sampling=false"]),
        ({"invert_sigmas": True}, ["invert_sigmas", "Mochi", "set invert_sigmas=false"]),
        ({"time_shift_type": "cosine"}, ["time_shift_type='cosine'", "'exponential' or 'linear'"]),
        ({"shift_terminal": 1.5}, ["shift_terminal", "(0, 1)"]),
        ({"shift": -1.0}, ["shift must be > 0"]),
        ({"use_karas_sigmas": False}, ["unknown", "use_karas_sigmas", "remove"]),
        ({"_class_name": "UniPCMultistepScheduler"}, ["'UniPCMultistepScheduler'", "sampler_for_diffusers_class"]),
    ],
)
def test_flow_euler_refuses(overrides: dict, fragments: list[str]) -> None:
    with pytest.raises(SchedulerConfigError) as info:
        FlowEulerSampler.from_config({**EULER, **overrides})
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"prediction_type": "epsilon"}, ["prediction_type='epsilon'", "set prediction_type='flow_prediction'"]),
        ({"prediction_type": "v_prediction"}, ["prediction_type='v_prediction'", "set prediction_type='flow_prediction'"]),
        ({"use_flow_sigmas": False}, ["use_flow_sigmas=False", "VP", "set use_flow_sigmas=True"]),
        ({"use_karras_sigmas": True}, ["use_karras_sigmas=True", "ignores flow_shift", "NaN/black", "set use_karras_sigmas=False"]),
        ({"use_exponential_sigmas": True}, ["use_exponential_sigmas=True", "set use_exponential_sigmas=False"]),
        ({"use_beta_sigmas": True}, ["use_beta_sigmas=True", "set use_beta_sigmas=False"]),
        ({"thresholding": True}, ["thresholding=True", "set thresholding=False"]),
        ({"predict_x0": False}, ["predict_x0=False", "set predict_x0=True"]),
        ({"solver_p": "DPMSolverMultistepScheduler"}, ["solver_p", "set solver_p=None"]),
        ({"solver_order": 4}, ["solver_order=4", "1, 2 or 3"]),
        ({"solver_type": "midpoint"}, ["solver_type='midpoint'", "'bh1' or 'bh2'"]),
        ({"solver_type": "bh1"}, ["bh1", "final_sigmas_type='zero'", "NaN", "final_sigmas_type='sigma_min'"]),
        ({"lower_order_final": False}, ["lower_order_final=false", "set lower_order_final=true"]),
        ({"final_sigmas_type": "one"}, ["final_sigmas_type='one'", "'zero' or 'sigma_min'"]),
        ({"time_shift_type": "cosine"}, ["time_shift_type='cosine'", "'exponential' or 'linear'"]),
        ({"flow_shift": 0}, ["flow_shift must be > 0"]),
        ({"disable_corrector": ["first"]}, ["disable_corrector", "step indices"]),
        ({"variance_type": None}, ["unknown", "variance_type", "remove"]),
        ({"_class_name": "FlowMatchEulerDiscreteScheduler"}, ["'FlowMatchEulerDiscreteScheduler'", "not 'UniPCMultistepScheduler'"]),
    ],
)
def test_flow_unipc_refuses(overrides: dict, fragments: list[str]) -> None:
    with pytest.raises(SchedulerConfigError) as info:
        FlowUniPCSampler.from_config({**WAN21_UNIPC, **overrides})
    for fragment in fragments:
        assert fragment in str(info.value)


def test_flow_unipc_refuses_configs_that_default_to_vp() -> None:
    """diffusers' defaults are epsilon prediction on VP sigmas: a config must opt into flow."""
    with pytest.raises(SchedulerConfigError, match="prediction_type='epsilon'"):
        FlowUniPCSampler.from_config({"num_train_timesteps": 1000})
    with pytest.raises(SchedulerConfigError, match="use_flow_sigmas=False"):
        FlowUniPCSampler.from_config({"prediction_type": "flow_prediction"})


@pytest.mark.parametrize(
    "overrides", [{"solver_type": "bh1"}, {"lower_order_final": False}, {"lower_order_final": False, "final_sigmas_type": "sigma_min", "solver_order": 3}]
)
def test_refused_unipc_combinations_break_diffusers_too(overrides: dict) -> None:
    """Why those combinations are load-time errors: diffusers' own last step is not finite."""
    scheduler = diffusers_scheduler({**WAN21_UNIPC, **overrides}, 10)
    assert not torch.isfinite(diffusers_trajectory(scheduler, initial_noise())[-1]).all()


def test_sampler_for_diffusers_class() -> None:
    assert sampler_for_diffusers_class("UniPCMultistepScheduler") == "flow_unipc"
    assert sampler_for_diffusers_class("FlowMatchEulerDiscreteScheduler") == "flow_euler"
    with pytest.raises(SchedulerConfigError) as info:
        sampler_for_diffusers_class("DPMSolverMultistepScheduler")
    assert "'DPMSolverMultistepScheduler'" in str(info.value)
    listed = str(info.value).split("supported classes: ")[1]
    assert "'FlowMatchEulerDiscreteScheduler'" in listed and "'UniPCMultistepScheduler'" in listed


def test_samplers_are_immutable() -> None:
    sampler = FlowUniPCSampler.from_config(WAN21_UNIPC)
    with pytest.raises(AttributeError):
        sampler.flow_shift = 5.0  # type: ignore[misc]
