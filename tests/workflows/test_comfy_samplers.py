"""ComfyUI's samplers on a flow model, with their seeded noise: our comfy_euler_ancestral /
comfy_dpmpp_2m / comfy_dpmpp_2m_sde(_heun)(_gpu) / comfy_res_multistep(_ancestral) /
comfy_dpmpp_sde(_gpu) / comfy_dpmpp_3m_sde(_gpu) equal ComfyUI's own sample_* functions over each schedule we run, and our
karras / exponential / ddim_uniform / linear_quadratic / kl_optimal sigmas equal its schedulers'
(golden/comfy_samplers.json, made by scripts/comfy_samplers_golden.py from a ComfyUI checkout:
golden/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler
from omniloop.workflows.schedules import SCHEDULES, flow_schedule, ksampler_sigmas

GOLDEN = json.loads((Path(__file__).parent / "golden" / "comfy_samplers.json").read_text())["cases"]
NAMES = {"euler_ancestral": "comfy_euler_ancestral", "dpmpp_2m": "comfy_dpmpp_2m",
         "dpmpp_2m_sde": "comfy_dpmpp_2m_sde", "dpmpp_2m_sde_gpu": "comfy_dpmpp_2m_sde_gpu",
         "res_multistep": "comfy_res_multistep", "res_multistep_ancestral": "comfy_res_multistep_ancestral",
         "dpmpp_sde": "comfy_dpmpp_sde", "dpmpp_sde_gpu": "comfy_dpmpp_sde_gpu",
         "dpmpp_3m_sde": "comfy_dpmpp_3m_sde", "dpmpp_3m_sde_gpu": "comfy_dpmpp_3m_sde_gpu"}
TWO_EVALUATIONS = ("dpmpp_sde", "dpmpp_sde_gpu")  # a ComfyUI step is two loop steps
SAMPLER_SCHEDULES = ("simple", "normal", "sgm_uniform", "beta")  # the sampler runs' schedules (ComfyUI's own)


def _run(sampler, state, x: torch.Tensor) -> torch.Tensor:
    """The denoise loop's calls on the toy flow model v = 0.5 x - sigma."""
    while not state.done:
        x = sampler.step(state, 0.5 * sampler.scale_model_input(state, x) - state.sigma, x)
    return x


def _sampler(case):
    """Ours for the case's sampler and node options; the SDE samplers' solver type is their name
    (ComfyUI's dpmpp_2m_sde_heun), their model_shift the case's ModelSamplingSD3 shift."""
    options, name = dict(case["options"]), NAMES[case["sampler"]]
    if options.pop("solver_type", "midpoint") == "heun":
        name = name.replace("_sde", "_sde_heun")
    if case["sampler"].startswith(("dpmpp_2m_sde", "dpmpp_sde", "dpmpp_3m_sde")):
        options["model_shift"] = case["shift"]
    return build_sampler(name, {"shift": 1.0, **options})


def test_the_table_covers_every_sampler_every_schedule_and_eta():
    assert set(SAMPLER_SCHEDULES) <= set(SCHEDULES)
    assert {(c["sampler"], c["scheduler"]) for c in GOLDEN} == {(s, k) for s in NAMES for k in SAMPLER_SCHEDULES}
    assert {c["options"].get("eta") for c in GOLDEN if c["sampler"] == "euler_ancestral"} == {0.0, 0.5, 1.0}
    assert {c["options"].get("eta") for c in GOLDEN if c["sampler"] == "dpmpp_2m_sde"} == {0.0, 0.5, 1.0}
    assert {c["options"].get("solver_type") for c in GOLDEN if c["sampler"] == "dpmpp_2m_sde"} == {"midpoint", "heun"}


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['sampler']}-{c['scheduler']}-shift{c['shift']:g}-"
                         f"{c['steps']}-eta{c['options'].get('eta', '')}")
def test_comfy_sampler_equals_comfyuis(case):
    """Our sigmas (KSampler's for this sampler) bit for bit, then the sampler over them from the
    same start and seed: ComfyUI's result (its noise drawn from the same generator)."""
    sigmas = ksampler_sigmas(case["scheduler"], case["steps"], case["shift"], case["sampler"])
    assert sigmas == case["sigmas"]
    sampler = _sampler(case)
    state = sampler.init_state(len(sigmas) - 1, sigmas=sigmas[:-1], shift=1.0, seed=case["seed"])
    x = _run(sampler, state, torch.tensor(case["x_init"], dtype=torch.float32))  # [2, 6]
    assert torch.equal(x, torch.tensor(case["x_final"]))  # bit for bit (CPU, float32)


@pytest.mark.parametrize("name", list(NAMES))
def test_step_many_equals_each_request_alone(name):
    """Three requests (different seeds and starts) at the same steps of one schedule, stepped as
    one batch: each request's rows equal its own run bit for bit (its own noise generator)."""
    case = next(c for c in GOLDEN if c["sampler"] == name and c["steps"] >= 4 and c["scheduler"] == "beta")
    sampler, sigmas = _sampler(case), case["sigmas"][:-1]
    starts = [torch.tensor(case["x_init"]) * k for k in (1.0, -0.5, 2.0)]
    alone = []
    for k, x in enumerate(starts):
        alone.append(_run(sampler, sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=k), x))
    states = [sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=k) for k in range(3)]
    x = torch.cat(starts)
    while not states[0].done:
        assert len({sampler.batch_key(s) for s in states}) == 1
        x = sampler.step_many(states, 0.5 * x - states[0].sigma, x)
    assert all(s.done for s in states)
    assert torch.equal(x, torch.cat(alone))


def test_ancestral_noise_is_the_seeds_and_a_failed_batch_rewinds_it():
    """Same seed, same result; another seed, another; a step_many that raises leaves the
    generators where they were (the loop then steps each request alone)."""
    case = next(c for c in GOLDEN if c["sampler"] == "euler_ancestral" and c["options"]["eta"] == 1.0
                and c["steps"] == 6 and c["scheduler"] == "simple")
    sampler, sigmas = _sampler(case), case["sigmas"][:-1]
    x0 = torch.tensor(case["x_init"])

    def run(seed):
        return _run(sampler, sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=seed), x0)

    assert torch.equal(run(42), run(42)) and not torch.equal(run(42), run(43))
    states = [sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=s) for s in (42, 43)]
    x = torch.cat([x0, x0])
    x = sampler.step_many(states, 0.5 * x - states[0].sigma, x)  # draws once each
    before = [s.generator.get_state().clone() for s in states]
    bad = torch.cat([x, x[:1]])  # 3 rows for 2 requests: both draw noise, then the update fails
    with pytest.raises(RuntimeError):
        sampler.step_many(states, 0.5 * bad - states[0].sigma, bad)
    assert [s.step_index for s in states] == [1, 1]
    assert all(torch.equal(s.generator.get_state(), b) for s, b in zip(states, before))


SCHEDULE_TABLE = json.loads((Path(__file__).parent / "golden" / "comfy_samplers.json").read_text())["schedules"]


def test_the_more_schedulers_equal_comfyuis_bit_for_bit():
    """karras / exponential / ddim_uniform / linear_quadratic / kl_optimal over a ModelSamplingSD3
    flow model: ComfyUI's sigmas (its own functions, shift 1 / 3 / 5 / 8, 2 to 30 steps)."""
    assert {c["scheduler"] for c in SCHEDULE_TABLE} == set(SCHEDULES) - set(SAMPLER_SCHEDULES)
    for case in SCHEDULE_TABLE:
        assert flow_schedule(case["scheduler"], case["steps"], case["shift"]) == case["sigmas"], case
    with pytest.raises(ValueError, match="kl_optimal needs steps >= 2"):
        flow_schedule("kl_optimal", 1, 3.0)


@pytest.mark.parametrize("scheduler", ["karras", "linear_quadratic"])
def test_ksampler_with_the_more_schedulers_compiles_to_their_sigmas(scheduler):
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("text_to_video_wan"))
    ksampler = next(n for n in api.values() if n["class_type"] == "KSampler")
    ksampler["inputs"].update(sampler_name="dpmpp_2m_sde_gpu", scheduler=scheduler, steps=8)
    (generation,) = compile_workflow(api, template_models(), exact=True).generations
    assert generation.request.diffusion.sigmas == flow_schedule(scheduler, 8, _shift(api))[:-1]
    assert generation.request.node_params["denoise"] == {"model_shift": _shift(api)}


def test_options_are_validated():
    with pytest.raises(ValueError, match="eta must be in"):
        build_sampler("comfy_euler_ancestral", {"eta": -1.0})
    with pytest.raises(ValueError, match="unknown ComfyDPMpp2M config keys"):
        build_sampler("comfy_dpmpp_2m", {"eta": 1.0})
    with pytest.raises(ValueError, match="eta must be in"):
        build_sampler("comfy_dpmpp_2m_sde", {"eta": 101.0})
    with pytest.raises(ValueError, match="model_shift must be > 0"):
        build_sampler("comfy_dpmpp_2m_sde_gpu", {"model_shift": 0.0})
    with pytest.raises(ValueError, match="unknown ComfyResMultistep config keys"):
        build_sampler("comfy_res_multistep", {"eta": 1.0})


def test_the_sde_sampler_starts_a_schedule_at_1_at_the_model_samplings_offset_and_its_noise_is_the_seeds():
    """A first sigma of 1 is ComfyUI's percent_to_sigma(1e-4) of the model_shift (the model is
    evaluated there); the Brownian noise is the seed's: same seed same run, another seed another."""
    case = next(c for c in GOLDEN if c["sampler"] == "dpmpp_2m_sde" and c["steps"] == 6 and c["scheduler"] == "simple")
    sampler, sigmas = _sampler(case), case["sigmas"][:-1]
    state = sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=1)
    t = 1 - 1e-4
    assert sigmas[0] == 1.0 and state.sigmas[0] == torch.tensor(3.0 * t / (1 + 2.0 * t))
    assert torch.equal(state.timesteps, state.sigmas[:-1] * 1000)
    x0 = torch.tensor(case["x_init"])

    def run(seed):
        return _run(sampler, sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=seed), x0)

    assert torch.equal(run(42), torch.tensor(case["x_final"])) and not torch.equal(run(42), run(43))


# -- the nodes: SamplerCustom, SamplerEulerAncestral, KSampler's sampler names ------------------
def _custom_wan(sampler_node: dict, scheduler: str = "beta", add_noise: bool = True) -> dict:
    """text_to_video_wan with its KSampler replaced by SamplerCustom over ``sampler_node`` and a
    BasicScheduler (the shape of the ltxv_* / video_wan_* templates)."""
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template

    api = ui_to_api(template("text_to_video_wan"))
    node_id, ks = next((k, n) for k, n in api.items() if n["class_type"] == "KSampler")
    inputs = ks["inputs"]
    api["900"] = sampler_node
    api["901"] = {"class_type": "BasicScheduler", "inputs": {"model": inputs["model"], "scheduler": scheduler,
                                                              "steps": 5, "denoise": 1.0}}
    api[node_id] = {"class_type": "SamplerCustom", "inputs": {
        "model": inputs["model"], "add_noise": add_noise, "noise_seed": 1234, "cfg": 4.0,
        "positive": inputs["positive"], "negative": inputs["negative"], "sampler": ["900", 0], "sigmas": ["901", 0],
        "latent_image": inputs["latent_image"]}}
    return api


def _shift(api: dict) -> float:
    return next(n["inputs"]["shift"] for n in api.values() if n["class_type"] == "ModelSamplingSD3")


def test_sampler_custom_with_euler_ancestral_compiles_to_comfyuis_sampler_schedule_and_knobs():
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.schedules import flow_schedule
    from tests.workflows.templates import template_models

    api = _custom_wan({"class_type": "SamplerEulerAncestral", "inputs": {"eta": 0.5, "s_noise": 1.0}})
    result = compile_workflow(api, template_models(), exact=True)
    (generation,) = result.generations
    request = generation.request
    assert request.diffusion.sampler == "comfy_euler_ancestral" and request.diffusion.shift == 1.0
    assert request.diffusion.sigmas == flow_schedule("beta", 5, _shift(api))[:-1]  # BasicScheduler: no discard
    assert request.diffusion.seed == 1234 and request.diffusion.guidance_scale == 4.0
    assert request.node_params["denoise"] == {"eta": 0.5}  # s_noise 1 is the default


@pytest.mark.parametrize("scheduler", ["simple", "sgm_uniform"])
def test_sampler_custom_with_ksampler_select_dpmpp_2m(scheduler):
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.schedules import flow_schedule
    from tests.workflows.templates import template_models

    api = _custom_wan({"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_2m"}}, scheduler)
    (generation,) = compile_workflow(api, template_models(), exact=True).generations
    assert generation.request.diffusion.sampler == "comfy_dpmpp_2m"
    assert generation.request.diffusion.sigmas == flow_schedule(scheduler, 5, _shift(api))[:-1]
    assert "denoise" not in generation.request.node_params


def test_sampler_dpmpp_sde_compiles_with_its_knobs_and_r_other_than_half_is_a_deviation():
    from omniloop.workflows import WorkflowError, compile_workflow
    from tests.workflows.templates import template_models

    api = _custom_wan({"class_type": "SamplerDPMPP_SDE", "inputs": {"eta": 1.0, "s_noise": 0.5, "r": 0.5,
                                                                     "noise_device": "cpu"}})
    (generation,) = compile_workflow(api, template_models(), exact=True).generations
    assert generation.request.diffusion.sampler == "comfy_dpmpp_sde"
    assert generation.request.node_params["denoise"] == {"s_noise": 0.5, "model_shift": _shift(api)}
    api["900"]["inputs"]["r"] = 0.3
    with pytest.raises(WorkflowError, match="r=0.3"):
        compile_workflow(api, template_models(), exact=True)
    api["900"]["inputs"]["r"] = 0.5
    api["901"]["inputs"]["denoise"] = 0.5  # a start mid-schedule: the model's own sampler, reported
    with pytest.raises(WorkflowError, match="'dpmpp_sde' does not start mid-schedule here"):
        compile_workflow(api, template_models(), exact=True)


def test_the_sde_samplers_noise_given_latents_at_comfyuis_first_sigma():
    """ComfyUI noises the start at the schedule's own first sigma (1: pure noise), before the
    sampler offsets it for the half log-SNR."""
    case = next(c for c in GOLDEN if c["sampler"] == "dpmpp_2m_sde" and c["steps"] == 6 and c["scheduler"] == "simple")
    sampler, sigmas = _sampler(case), case["sigmas"][:-1]
    state = sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=1)
    original, noise = torch.full((2, 6), 0.5), torch.randn(2, 6)
    assert torch.equal(sampler.add_noise(state, original, noise), noise)
    state.step_index = 2
    sigma = state.sigmas[2]
    assert torch.equal(sampler.add_noise(state, original, noise), sigma * noise + (1.0 - sigma) * original)


@pytest.mark.parametrize("solver_type,device,ours", [("midpoint", "cpu", "comfy_dpmpp_2m_sde"),
                                                     ("heun", "gpu", "comfy_dpmpp_2m_sde_heun_gpu")])
def test_sampler_dpmpp_2m_sde_compiles_to_its_sampler_knobs_and_the_model_shift(solver_type, device, ours):
    from omniloop.workflows import compile_workflow
    from tests.workflows.templates import template_models

    api = _custom_wan({"class_type": "SamplerDPMPP_2M_SDE", "inputs": {
        "solver_type": solver_type, "eta": 0.5, "s_noise": 1.0, "noise_device": device}})
    (generation,) = compile_workflow(api, template_models(), exact=True).generations
    assert generation.request.diffusion.sampler == ours and generation.request.diffusion.shift == 1.0
    assert generation.request.node_params["denoise"] == {"eta": 0.5, "model_shift": _shift(api)}


def test_ksampler_res_multistep_compiles_without_knobs():
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("text_to_video_wan"))
    ksampler = next(n for n in api.values() if n["class_type"] == "KSampler")
    ksampler["inputs"]["sampler_name"] = "res_multistep"
    (generation,) = compile_workflow(api, template_models(), exact=True).generations
    assert generation.request.diffusion.sampler == "comfy_res_multistep"
    assert "denoise" not in generation.request.node_params


def test_sampler_custom_without_noise_and_unsupported_samplers_are_refused_naming_the_supported():
    from omniloop.workflows import WorkflowError, compile_workflow
    from tests.workflows.templates import template_models

    api = _custom_wan({"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}, add_noise=False)
    with pytest.raises(WorkflowError) as e:
        compile_workflow(api, template_models())
    assert "adds no noise" in str(e.value)
    api = _custom_wan({"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_2s_ancestral"}})
    with pytest.raises(WorkflowError) as e:
        compile_workflow(api, template_models(), exact=True)
    (error,) = e.value.to_comfy()["node_errors"].values()
    assert error["class_type"] == "SamplerCustom"
    message = str(error["errors"])
    assert "dpmpp_2s_ancestral" in message and "'euler_ancestral'" in message and "'dpmpp_3m_sde'" in message


def test_a_sampler_custom_euler_ancestral_workflow_runs_reproducibly_with_its_eta(wan_t2v_dir):
    """The engine runs the compiled request: ComfyUI's ancestral sampler with the node's eta, its
    noise drawn from the prompt's seed (the same prompt twice: the same video; eta 0, the
    noiseless step: another)."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.workflows import compile_workflow
    from tests.workflows.templates import template_models
    from tests.workflows.test_run_templates import small

    def request(eta: float):
        api = small(_custom_wan({"class_type": "SamplerEulerAncestral", "inputs": {"eta": eta, "s_noise": 1.0}}))
        api["901"]["inputs"]["steps"] = 3
        (generation,) = compile_workflow(api, template_models({"wan": wan_t2v_dir})).generations
        return generation.request

    with VideoGenerator.from_pretrained(str(wan_t2v_dir)) as gen:
        runs = [gen.generate(request(eta)) for eta in (0.5, 0.5, 0.0)]
        wrong = request(0.5)
        wrong = wrong.model_copy(update={"diffusion": wrong.diffusion.model_copy(update={"sampler": "flow_euler"})})
        with pytest.raises(ValueError, match=r"node_params\['denoise'\].eta: sampler 'flow_euler' takes no ancestral"):
            gen.generate(wrong)
    assert all(out.failure is None for out in runs), [out.failure for out in runs]
    frames = [torch.as_tensor(out.artifacts["video"].frames) for out in runs]
    assert torch.equal(frames[0], frames[1])
    assert not torch.equal(frames[0], frames[2])


@pytest.mark.parametrize("node", [
    {"class_type": "SamplerDPMPP_2M_SDE", "inputs": {"solver_type": "midpoint", "eta": 0.5, "s_noise": 1.0,
                                                     "noise_device": "cpu"}},
    {"class_type": "SamplerDPMPP_SDE", "inputs": {"eta": 0.5, "s_noise": 1.0, "r": 0.5, "noise_device": "cpu"}}],
    ids=["dpmpp_2m_sde", "dpmpp_sde"])
def test_an_sde_sampler_workflow_runs_reproducibly_on_its_seeds_brownian_noise(wan_t2v_dir, node):
    """The engine admits the SDE samplers' knobs (eta, the model's shift) and runs them (dpmpp_sde:
    two evaluations a step): the same prompt twice, the same video; another seed, another."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.workflows import compile_workflow
    from tests.workflows.templates import template_models
    from tests.workflows.test_run_templates import small

    def request(seed: int):
        api = small(_custom_wan(node))
        api["901"]["inputs"]["steps"] = 3
        next(n for n in api.values() if n["class_type"] == "SamplerCustom")["inputs"]["noise_seed"] = seed
        (generation,) = compile_workflow(api, template_models({"wan": wan_t2v_dir})).generations
        return generation.request

    with VideoGenerator.from_pretrained(str(wan_t2v_dir)) as gen:
        runs = [gen.generate(request(seed)) for seed in (1, 1, 2)]
    assert all(out.failure is None for out in runs), [out.failure for out in runs]
    frames = [torch.as_tensor(out.artifacts["video"].frames) for out in runs]
    assert torch.equal(frames[0], frames[1])
    assert not torch.equal(frames[0], frames[2])


# -- CFGZeroStar ------------------------------------------------------------------------------
ZERO_STAR = json.loads((Path(__file__).parent / "golden" / "comfy_samplers.json").read_text())["cfg_zero_star"]


@pytest.mark.parametrize("case", ZERO_STAR, ids=lambda c: f"sigma{c['sigma']}-cfg{c['scale']}")
def test_cfg_zero_star_equals_comfyuis_patch(case):
    """Our velocity-space patch, read back as ComfyUI's clean estimate (x - v * sigma), equals
    ComfyUI's CFGZeroStar post-CFG result on the same branch predictions."""
    from omniloop.pipeline.policies.cfg_zero_star import cfg_zero_star

    x, sigma = torch.tensor(case["x"]), torch.tensor(case["sigma"])
    v = cfg_zero_star(x, sigma, torch.tensor(case["v_cond"]), torch.tensor(case["v_uncond"]), case["scale"])
    torch.testing.assert_close(x - v * sigma, torch.tensor(case["result_denoised"]), rtol=0, atol=5e-6)
    plain = torch.tensor(case["v_uncond"]) + case["scale"] * (torch.tensor(case["v_cond"]) - torch.tensor(case["v_uncond"]))
    assert (v - plain).abs().max() > 1e-3  # it is not plain CFG


def test_a_cfg_zero_star_workflow_compiles_and_runs_patched(wan_t2v_dir):
    """CFGZeroStar on the model: the request's denoise knob; the engine's result differs from the
    unpatched one's; a sampler that is not a flow sampler is refused at admission."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.workflows import compile_workflow
    from tests.workflows.templates import template_models
    from tests.workflows.test_run_templates import small

    def request(patched: bool):
        api = small(_custom_wan({"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}))
        api["901"]["inputs"]["steps"] = 2
        if patched:
            sampler_custom = next(n for n in api.values() if n["class_type"] == "SamplerCustom")
            api["902"] = {"class_type": "CFGZeroStar", "inputs": {"model": sampler_custom["inputs"]["model"]}}
            sampler_custom["inputs"]["model"] = ["902", 0]
        (generation,) = compile_workflow(api, template_models({"wan": wan_t2v_dir}), exact=True).generations
        return generation.request

    patched = request(True)
    assert patched.node_params["denoise"] == {"cfg_zero_star": True} and patched.diffusion.guidance_scale == 4.0
    with VideoGenerator.from_pretrained(str(wan_t2v_dir)) as gen:
        runs = [gen.generate(r) for r in (patched, request(False))]
        wrong = patched.model_copy(update={"diffusion": patched.diffusion.model_copy(update={"sampler": "flow_unipc"})})
        with pytest.raises(ValueError, match=r"cfg_zero_star: CFG-Zero\* patches a flow model's guidance"):
            gen.generate(wrong)
    assert all(out.failure is None for out in runs), [out.failure for out in runs]
    frames = [torch.as_tensor(out.artifacts["video"].frames) for out in runs]
    assert not torch.equal(frames[0], frames[1])


def test_on_the_ltx2_two_stage_path_comfyuis_samplers_stay_deviations():
    """video_ltx2_t2v (KSamplerSelect euler_ancestral, a joint audio-video latent, two stages):
    the model's own sampler runs, reported naming what runs there; exact refuses it."""
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import WorkflowError, compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("video_ltx2_t2v"))
    result = compile_workflow(api, template_models())
    assert result.generations[0].request.diffusion.sampler is None
    assert any("'euler_ancestral' is not supported on a joint audio-video latent" in d.message
               and "['euler']" in d.message for d in result.deviations)
    with pytest.raises(WorkflowError, match="euler_ancestral"):
        compile_workflow(api, template_models(), exact=True)


def test_dpmpp_sde_runs_two_evaluations_a_step_and_refuses_a_start_from_given_latents_mid_schedule():
    case = next(c for c in GOLDEN if c["sampler"] == "dpmpp_sde" and c["steps"] == 6 and c["scheduler"] == "simple")
    sampler, sigmas = _sampler(case), case["sigmas"][:-1]
    state = sampler.init_state(len(sigmas), sigmas=sigmas, shift=1.0, seed=1)
    assert state.num_steps == 2 * len(sigmas) - 1  # the last step is the denoising step's one evaluation
    assert state.sigmas[2] == torch.tensor(sigmas[1]) and sigmas[2] < state.sigmas[3] < sigmas[1]
    original, noise = torch.full((2, 6), 0.5), torch.randn(2, 6)
    assert state.sigmas[0] < 1 and torch.equal(sampler.add_noise(state, original, noise), noise)  # ComfyUI's sigma 1
    state.step_index = 2
    with pytest.raises(ValueError, match="'comfy_dpmpp_sde' does not start from given latents mid-schedule"):
        sampler.add_noise(state, original, noise)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in TWO_EVALUATIONS])
def test_a_run_from_given_latents_is_comfyuis_run_over_the_rest_of_the_schedule(name):
    """A loop from given latents starts mid-schedule (step_index = start): the sampler runs the
    remaining sigmas as a fresh ComfyUI run over them (a fresh noise generator, no history)."""
    case = next(c for c in GOLDEN if c["sampler"] == name and c["steps"] >= 4 and c["scheduler"] == "normal")
    sampler, sigmas, start = _sampler(case), case["sigmas"], 2
    steps = len(sigmas) - 1
    x0 = torch.tensor(case["x_init"])
    late = sampler.init_state(steps, sigmas=sigmas[:-1], shift=1.0, seed=5)
    late.step_index = start
    fresh = sampler.init_state(steps - start, sigmas=sigmas[start:-1], shift=1.0, seed=5)
    assert torch.equal(_run(sampler, late, x0), _run(sampler, fresh, x0))


def test_on_an_audio_latent_a_flow_only_sampler_is_a_deviation():
    """audio_stable_audio_example asks for dpmpp_3m_sde_gpu / exponential, which runs on the
    v-prediction model (comfy_v_dpmpp_3m_sde_gpu); res_multistep, a flow-model sampler here, is
    reported and the model's own sampler runs."""
    pytest.importorskip("comfyui_workflow_templates_json")
    from omniloop.workflows import compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template, template_models

    api = ui_to_api(template("audio_stable_audio_example"))
    assert compile_workflow(api, template_models()).generations[0].request.diffusion.sampler \
        == "comfy_v_dpmpp_3m_sde_gpu"
    for node in api.values():
        if node["class_type"] == "KSampler":
            node["inputs"]["sampler_name"] = "res_multistep"
    result = compile_workflow(api, template_models())
    assert result.generations[0].request.diffusion.sampler is None
    assert any("sampler_name='res_multistep' is not supported on this v-prediction model" in d.message
               for d in result.deviations)