"""Write tests/workflows/golden/comfy_samplers.json by running ComfyUI's own k-diffusion samplers once.

ComfyUI is GPL-3.0: nothing of it is in this repository. This script reads a ComfyUI git
checkout given on the command line (``git show HEAD:<path>``) and executes, extracted by name
with ``ast``: ``to_d``, ``default_noise_sampler``, ``sample_euler_ancestral_RF`` (what
``sample_euler_ancestral`` runs for a CONST (flow) model) and ``sample_dpmpp_2m``
(comfy/k_diffusion/sampling.py), ``append_dims`` (comfy/k_diffusion/utils.py),
``time_snr_shift``, ``reshape_sigma``, ``CONST``, ``ModelSamplingDiscreteFlow``
(comfy/model_sampling.py) and ``simple_scheduler``, ``normal_scheduler``, ``beta_scheduler``
(comfy/samplers.py). It drives them as ``KSAMPLER.sample`` does for a flow model under
``ModelSamplingSD3(shift)``: the scheduler's sigmas, CONST ``noise_scaling`` of the start, the
sampler with ``extra_args={"seed": seed}`` (the ancestral sampler's noise: its
``default_noise_sampler``, a generator on the sample's device seeded ``seed + 1`` on the CPU),
``inverse_noise_scaling``. The model is the toy flow model of comfy_flow_schedules.json:
velocity ``v = 0.5 * x - sigma``, denoised by CONST's ``x - v * sigma``; the start is
``linspace(-1, 1, 12)`` as a ``[2, 6]`` batch (two latent rows: the noise is drawn for both at once).
``cfg_zero_star``: ComfyUI's ``CFGZeroStar`` (comfy_extras/nodes_cfg.py: ``optimized_scale`` and
the node class, its ``execute`` run on a stand-in model that keeps the post-CFG function it sets)
on seeded random branch velocities turned into clean estimates by CONST: the patched result.

``--v-out`` (tests/workflows/golden/comfy_v_samplers.json): the same samplers (``sample_euler``,
``sample_dpmpp_2m``, ``sample_dpmpp_2m_sde(_gpu)``, ``sample_dpmpp_3m_sde(_gpu)``) on Stable Audio's
model sampling: ``EPS``, ``V_PREDICTION``, ``ModelSamplingContinuousEDM``, ``ModelSamplingContinuousV``
(comfy/model_sampling.py) built from ``StableAudio.sampling_settings`` (sigma_min 0.03, sigma_max
500), the schedulers as ``calculate_sigmas`` calls them (simple / normal / sgm_uniform on the model
sampling, karras / exponential on its float range), the start as ``KSAMPLER.sample`` makes it
(``Sampler.max_denoise`` of comfy/samplers.py, ``EPS.noise_scaling``). The model is
``BaseModel._apply_model``'s path on a toy DiT: input ``calculate_input(sigma, x)``, timestep
``model_sampling.timestep(sigma)``, velocity ``v = 0.5 * input - timestep``, ``calculate_denoised``.

    python scripts/comfy_samplers_golden.py /path/to/ComfyUI [--out tests/workflows/golden/comfy_samplers.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
from functools import partial
from pathlib import Path

import numpy
import scipy.stats
import torch
import torchsde

SCHEDULERS = ("simple", "normal", "sgm_uniform", "beta")
# (sampler, options, shift, steps, seed)
CASES = [("euler_ancestral", {"eta": 1.0, "s_noise": 1.0}, 3.0, 6, 42),
         ("euler_ancestral", {"eta": 0.5, "s_noise": 0.8}, 8.0, 4, 7),
         ("euler_ancestral", {"eta": 0.0, "s_noise": 1.0}, 5.0, 5, 3),
         ("euler_ancestral", {"eta": 1.0, "s_noise": 1.0}, 5.0, 1, 11),
         ("dpmpp_2m", {}, 3.0, 6, 0),
         ("dpmpp_2m", {}, 8.0, 4, 0),
         ("dpmpp_2m", {}, 5.0, 1, 0),
         # the Brownian-tree SDE samplers (torchsde's tree seeded with the prompt's seed) and res_multistep
         ("dpmpp_2m_sde", {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"}, 3.0, 6, 42),
         ("dpmpp_2m_sde", {"eta": 0.5, "s_noise": 0.8, "solver_type": "heun"}, 8.0, 4, 7),
         ("dpmpp_2m_sde", {"eta": 0.0, "s_noise": 1.0, "solver_type": "midpoint"}, 5.0, 5, 3),
         ("dpmpp_2m_sde", {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"}, 5.0, 1, 11),
         ("dpmpp_2m_sde_gpu", {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"}, 3.0, 6, 42),
         ("res_multistep", {}, 3.0, 6, 0),
         ("res_multistep", {}, 8.0, 4, 0),
         ("res_multistep", {}, 5.0, 1, 0),
         ("res_multistep_ancestral", {"eta": 1.0, "s_noise": 1.0}, 3.0, 6, 42),
         ("res_multistep_ancestral", {"eta": 0.5, "s_noise": 0.8}, 8.0, 4, 7),
         # two model evaluations a step (the second at the step's midpoint in half log-SNR)
         ("dpmpp_sde", {"eta": 1.0, "s_noise": 1.0}, 3.0, 6, 42),
         ("dpmpp_sde", {"eta": 0.5, "s_noise": 0.8}, 8.0, 4, 7),
         ("dpmpp_sde", {"eta": 0.0, "s_noise": 1.0}, 5.0, 5, 3),
         ("dpmpp_sde", {"eta": 1.0, "s_noise": 1.0}, 5.0, 1, 11),
         ("dpmpp_sde_gpu", {"eta": 1.0, "s_noise": 1.0}, 3.0, 6, 42),
         ("dpmpp_3m_sde", {"eta": 1.0, "s_noise": 1.0}, 3.0, 6, 42),
         ("dpmpp_3m_sde", {"eta": 0.5, "s_noise": 0.8}, 8.0, 4, 7),
         ("dpmpp_3m_sde", {"eta": 0.0, "s_noise": 1.0}, 5.0, 5, 3),
         ("dpmpp_3m_sde", {"eta": 1.0, "s_noise": 1.0}, 5.0, 1, 11),
         ("dpmpp_3m_sde_gpu", {"eta": 1.0, "s_noise": 1.0}, 5.0, 6, 11)]
# the schedulers without a table of their own (comfy_flow_schedules.json has simple / normal / sgm_uniform / beta)
MORE_SCHEDULERS = ("karras", "exponential", "ddim_uniform", "linear_quadratic", "kl_optimal")


def source(repo: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def extract(text: str, names: set[str], namespace: dict) -> None:
    """Execute the top-level functions / classes of ``text`` named in ``names`` into ``namespace``
    (decorators dropped: ``torch.no_grad`` changes no value)."""
    tree = ast.parse(text)
    picked = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    missing = names - {node.name for node in picked}
    assert not missing, f"not found: {missing}"
    for node in picked:
        node.decorator_list = []
    exec(compile(ast.Module(body=picked, type_ignores=[]), "<comfyui>", "exec"), namespace)


def cfg_zero_star_cases(repo: Path, const) -> list[dict]:
    """ComfyUI's CFGZeroStar patch (comfy_extras/nodes_cfg.py: ``optimized_scale`` and the class,
    its ``execute`` run on a stand-in model that hands back the post-CFG function it sets) on
    random branch velocities: the inputs, and the patched result in ComfyUI's denoised space."""
    class Io:  # what the node's schema needs of comfy_api's io, nothing it computes with
        ComfyNode = object
        NodeOutput = staticmethod(lambda *values: values)

    class Model:
        post_cfg = None

        def clone(self):
            return self

        def set_model_sampler_post_cfg_function(self, fn):
            self.post_cfg = fn

    ns: dict = {"torch": torch, "io": Io, "override": lambda f: f}
    extract(source(repo, "comfy_extras/nodes_cfg.py"), {"optimized_scale", "CFGZeroStar"}, ns)
    model = Model()
    ns["CFGZeroStar"].execute(model)
    cases = []
    for seed, (sigma, scale, shape) in enumerate(((0.9, 5.0, (2, 3, 4)), (0.3, 3.5, (1, 2, 2, 3)), (1.0, 1.5, (3, 5)))):
        gen = torch.Generator().manual_seed(seed)
        x, v_cond, v_uncond = (torch.randn(shape, generator=gen) for _ in range(3))
        sigma_t = torch.full((shape[0],), sigma)
        cond, uncond = const.calculate_denoised(sigma_t, v_cond, x), const.calculate_denoised(sigma_t, v_uncond, x)
        out = uncond + (cond - uncond) * scale  # cfg_function's result (no sampler_cfg_function)
        result = model.post_cfg({"denoised": out, "cond_scale": scale, "cond_denoised": cond,
                                 "uncond_denoised": uncond, "input": x, "sigma": sigma_t})
        cases.append({"sigma": sigma, "scale": scale, "x": x.tolist(), "v_cond": v_cond.tolist(),
                      "v_uncond": v_uncond.tolist(), "result_denoised": result.tolist()})
    return cases


class ToyModel:
    """The toy flow model as a k-diffusion denoiser, with the path to its model sampling the SDE
    samplers read (``model.inner_model.model_patcher.get_model_object('model_sampling')``)."""

    def __init__(self, const, sampling):
        self.const, self.sampling = const, sampling
        patcher = type("Patcher", (), {"get_model_object": staticmethod(lambda name: sampling)})
        self.inner_model = type("Inner", (), {"model_patcher": patcher})

    def __call__(self, x, sigma, **kwargs):
        v = 0.5 * x - sigma.view(-1, 1)  # the toy velocity at the model input
        return self.const.calculate_denoised(sigma, v, x)


class ToyVModel:
    """A toy v-prediction DiT behind ComfyUI's model wrapper (``BaseModel._apply_model``), as the
    k-diffusion denoiser the samplers call, with the path to its model sampling."""

    def __init__(self, sampling):
        self.sampling = sampling
        patcher = type("Patcher", (), {"get_model_object": staticmethod(lambda name: sampling)})
        self.inner_model = type("Inner", (), {"model_patcher": patcher, "model_sampling": sampling})

    def __call__(self, x, sigma, **kwargs):
        xc = self.sampling.calculate_input(sigma, x)
        t = self.sampling.timestep(sigma).float()
        v = 0.5 * xc - t.view(-1, 1)  # the toy DiT
        return self.sampling.calculate_denoised(sigma, v.float(), x)


V_SCHEDULERS = ("simple", "normal", "sgm_uniform", "karras", "exponential")
# (sampler, options, steps, seed)
V_CASES = [("euler", {}, 6, 0), ("euler", {}, 1, 0),
           ("dpmpp_2m", {}, 6, 0), ("dpmpp_2m", {}, 3, 0),
           ("dpmpp_2m_sde", {"eta": 1.0, "s_noise": 1.0}, 6, 42),
           ("dpmpp_2m_sde", {"eta": 0.5, "s_noise": 0.8}, 4, 7),
           ("dpmpp_2m_sde_gpu", {"eta": 1.0, "s_noise": 1.0}, 5, 11),
           ("dpmpp_3m_sde", {"eta": 1.0, "s_noise": 1.0}, 6, 42),
           ("dpmpp_3m_sde", {"eta": 0.0, "s_noise": 1.0}, 5, 3),
           ("dpmpp_3m_sde_gpu", {"eta": 1.0, "s_noise": 1.0}, 8, 11)]


def v_prediction_cases(repo: Path, ns: dict, samplers: dict) -> dict:
    """Stable Audio's ``V_PREDICTION_CONTINUOUS`` model sampling (see the module docstring)."""
    extract(source(repo, "comfy/model_sampling.py"),
            {"EPS", "V_PREDICTION", "ModelSamplingContinuousEDM", "ModelSamplingContinuousV"}, ns)
    extract(source(repo, "comfy/samplers.py"), {"Sampler"}, ns)
    extract(source(repo, "comfy/k_diffusion/sampling.py"), {"sample_euler"}, ns)
    settings = {"sigma_max": 500.0, "sigma_min": 0.03}  # comfy/supported_models.py StableAudio
    config = type("Config", (), {"sampling_settings": settings})
    v_sampling = type("VSampling", (ns["ModelSamplingContinuousV"], ns["V_PREDICTION"]), {})
    schedulers = {"simple": ns["simple_scheduler"], "normal": ns["normal_scheduler"],
                  "sgm_uniform": partial(ns["normal_scheduler"], sgm=True),
                  "karras": partial(_unpacked, ns["get_sigmas_karras"]),
                  "exponential": partial(_unpacked, ns["get_sigmas_exponential"])}
    runs = {**samplers, "euler": ns["sample_euler"]}
    x_init = torch.linspace(-1, 1, 12).reshape(2, 6)
    cases = []
    for sampler_name, options, steps, seed in V_CASES:
        for scheduler in V_SCHEDULERS:
            sampling = v_sampling(config)
            sigmas = schedulers[scheduler](sampling, steps)
            model = ToyVModel(sampling)
            max_denoise = ns["Sampler"].max_denoise(None, model, sigmas)
            x = sampling.noise_scaling(sigmas[0], x_init.clone(), torch.zeros_like(x_init), max_denoise)
            out = runs[sampler_name](model, x, sigmas, extra_args={"seed": seed}, disable=True, **options)
            out = sampling.inverse_noise_scaling(sigmas[-1], out)
            cases.append({"sampler": sampler_name, "options": options, "scheduler": scheduler, "steps": steps,
                          "seed": seed, "max_denoise": max_denoise, "sigmas": sigmas.tolist(),
                          "timesteps": sampling.timestep(sigmas[:-1]).tolist(), "x_init": x_init.tolist(),
                          "x_final": out.tolist()})
    schedules = []
    for scheduler in V_SCHEDULERS:
        for steps in (1, 2, 4, 20, 100, 250):
            sigmas = schedulers[scheduler](v_sampling(config), steps)
            schedules.append({"scheduler": scheduler, "steps": steps, "sigmas": sigmas.tolist()})
    return {"sampling_settings": settings, "cases": cases, "schedules": schedules}


def _unpacked(handler, sampling, steps):
    """A scheduler ``calculate_sigmas`` calls with the model sampling's range (``use_ms=False``)."""
    return handler(n=steps, sigma_min=float(sampling.sigma_min), sigma_max=float(sampling.sigma_max))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("comfyui", type=Path, help="a ComfyUI git checkout (its .git or work tree)")
    parser.add_argument("--out", type=Path, default=Path("tests/workflows/golden/comfy_samplers.json"))
    parser.add_argument("--v-out", type=Path, default=Path("tests/workflows/golden/comfy_v_samplers.json"))
    args = parser.parse_args()
    revision = subprocess.run(["git", "-C", str(args.comfyui), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    utils: dict = {"torch": torch}
    extract(source(args.comfyui, "comfy/k_diffusion/utils.py"), {"append_dims"}, utils)
    comfy = type("comfy", (), {"model_sampling": type("model_sampling", (), {})})
    ns: dict = {"torch": torch, "math": math, "numpy": numpy, "scipy": scipy, "partial": partial, "nn": torch.nn,
                "torchsde": torchsde, "comfy": comfy,
                "trange": lambda n, disable=None: range(n), "utils": type("utils", (), utils)}
    extract(source(args.comfyui, "comfy/model_sampling.py"),
            {"time_snr_shift", "reshape_sigma", "CONST", "ModelSamplingDiscreteFlow"}, ns)
    comfy.model_sampling.CONST = ns["CONST"]  # what sigma_to_half_log_snr tests the model sampling against
    extract(source(args.comfyui, "comfy/k_diffusion/sampling.py"),
            {"to_d", "default_noise_sampler", "sample_euler_ancestral_RF", "sample_dpmpp_2m", "append_zero",
             "get_sigmas_karras", "get_sigmas_exponential", "get_ancestral_step", "BatchedBrownianTree",
             "BrownianTreeNoiseSampler", "sigma_to_half_log_snr", "half_log_snr_to_sigma",
             "offset_first_sigma_for_snr", "sample_dpmpp_2m_sde", "sample_dpmpp_2m_sde_gpu", "res_multistep",
             "sample_res_multistep", "sample_res_multistep_ancestral", "sample_dpmpp_sde", "sample_dpmpp_sde_gpu", "sample_dpmpp_3m_sde",
             "sample_dpmpp_3m_sde_gpu"}, ns)
    extract(source(args.comfyui, "comfy/samplers.py"),
            {"simple_scheduler", "normal_scheduler", "beta_scheduler", "ddim_scheduler", "linear_quadratic_schedule",
             "kl_optimal_scheduler"}, ns)
    schedulers = {"simple": ns["simple_scheduler"], "normal": ns["normal_scheduler"],
                  "sgm_uniform": partial(ns["normal_scheduler"], sgm=True), "beta": ns["beta_scheduler"]}
    samplers = {"euler_ancestral": ns["sample_euler_ancestral_RF"], "dpmpp_2m": ns["sample_dpmpp_2m"],
                "dpmpp_2m_sde": ns["sample_dpmpp_2m_sde"], "dpmpp_2m_sde_gpu": ns["sample_dpmpp_2m_sde_gpu"],
                "res_multistep": ns["sample_res_multistep"],
                "res_multistep_ancestral": ns["sample_res_multistep_ancestral"], "dpmpp_sde": ns["sample_dpmpp_sde"],
                "dpmpp_sde_gpu": ns["sample_dpmpp_sde_gpu"], "dpmpp_3m_sde": ns["sample_dpmpp_3m_sde"],
                "dpmpp_3m_sde_gpu": ns["sample_dpmpp_3m_sde_gpu"]}
    # what ComfyUI's model of a ModelSamplingSD3 flow model is: the discrete flow sampling and CONST in one
    flow_sampling = type("FlowSampling", (ns["ModelSamplingDiscreteFlow"], ns["CONST"]), {})

    x_init = torch.linspace(-1, 1, 12).reshape(2, 6)
    cases = []
    for sampler_name, options, shift, steps, seed in CASES:
        for scheduler in SCHEDULERS:
            sampling = flow_sampling()
            sampling.set_parameters(shift=shift)
            sigmas = schedulers[scheduler](sampling, steps)
            const = ns["CONST"]()
            x = const.noise_scaling(sigmas[0], x_init, torch.zeros_like(x_init))
            model = ToyModel(const, sampling)

            out = samplers[sampler_name](model, x, sigmas, extra_args={"seed": seed}, disable=True, **options)
            out = const.inverse_noise_scaling(sigmas[-1], out)
            cases.append({"sampler": sampler_name, "options": options, "scheduler": scheduler, "shift": shift,
                          "steps": steps, "seed": seed, "sigmas": sigmas.tolist(), "x_init": x_init.tolist(),
                          "x_final": out.tolist()})
    table_zero_star = cfg_zero_star_cases(args.comfyui, ns["CONST"]())
    schedules = []
    more = {"karras": partial(_unpacked, ns["get_sigmas_karras"]), "exponential": partial(_unpacked, ns["get_sigmas_exponential"]),
            "ddim_uniform": ns["ddim_scheduler"], "linear_quadratic": ns["linear_quadratic_schedule"],
            "kl_optimal": partial(_unpacked, ns["kl_optimal_scheduler"])}
    for scheduler in MORE_SCHEDULERS:  # as calculate_sigmas calls them
        for shift in (1.0, 3.0, 5.0, 8.0):
            for steps in (2, 4, 20, 30):
                sampling = flow_sampling()
                sampling.set_parameters(shift=shift)
                schedules.append({"scheduler": scheduler, "shift": shift, "steps": steps,
                                  "sigmas": more[scheduler](sampling, steps).tolist()})
    table = {"source": f"ComfyUI {revision}: comfy/k_diffusion/sampling.py sample_euler_ancestral_RF / "
                       "sample_dpmpp_2m, driven as KSAMPLER does for a flow model (scripts/comfy_samplers_golden.py)",
             "cases": cases, "cfg_zero_star": table_zero_star, "schedules": schedules}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(cases)} cases -> {args.out}")
    v_table = {"source": f"ComfyUI {revision}: comfy/k_diffusion/sampling.py sample_euler / sample_dpmpp_2m / "
                         "sample_dpmpp_2m_sde(_gpu) / sample_dpmpp_3m_sde(_gpu) on StableAudio's V_PREDICTION "
                         "ModelSamplingContinuousV, driven as KSAMPLER does (scripts/comfy_samplers_golden.py)",
               **v_prediction_cases(args.comfyui, ns, samplers)}
    args.v_out.write_text(json.dumps(v_table, indent=1) + "\n")
    print(f"{len(v_table['cases'])} v-prediction cases -> {args.v_out}")


if __name__ == "__main__":
    main()
