"""Every registered sampler steps CUDA latents (run through the device tool, never in CI).

A sampler keeps its schedule on the host (the scheduler reads it there); each step must still
compute on the latents' device. ComfyUI's UniPC once mixed its host times into a CUDA update
(``bench_comfy.py``'s Wan template crashed on the H100), which the CPU tests cannot see. Each
sampler's CUDA trajectory is compared with its CPU one on the same model outputs and seed.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler, sampler_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIGS = {"flow_unipc": {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}}
# Samplers whose noise is drawn on the sample's device, as their references draw it (ComfyUI's
# default_noise_sampler: a generator on the latent's device; diffusers' cosine DPM-Solver's
# Brownian tree; ComfyUI's "_gpu" SDE samplers): a CUDA run draws other noise than a CPU one,
# so a seed must reproduce the CUDA trajectory instead.
DEVICE_NOISE = {"comfy_euler_ancestral", "comfy_res_multistep_ancestral", "cosine_dpmsolver"}


@pytest.mark.parametrize("name", sampler_names())
def test_a_sampler_steps_cuda_latents_as_it_steps_cpu_ones(name):
    sampler = build_sampler(name, CONFIGS.get(name, {}))
    steps, shape = 6, (1, 4, 2, 3, 3)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=g)
    outputs = [torch.randn(shape, generator=g) for _ in range(steps)]
    finals = {}
    for run, device in (("cpu", "cpu"), ("cuda", "cuda"), ("cuda again", "cuda")):
        state = sampler.init_state(steps, device=device, seed=0)
        x = x0.to(device)
        for v in outputs:
            x = sampler.step(state, v.to(device), x)
            assert x.device.type == device
        finals[run] = x.cpu()
    assert torch.isfinite(finals["cuda"]).all()
    if name in DEVICE_NOISE or name.endswith("_gpu"):
        assert torch.equal(finals["cuda"], finals["cuda again"]), "a seed reproduces the CUDA trajectory"
    else:
        torch.testing.assert_close(finals["cuda"], finals["cpu"], rtol=1e-4, atol=1e-4)
