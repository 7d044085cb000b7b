"""Write tests/workflows/golden/comfy_unipc.json by running ComfyUI's own UniPC once.

ComfyUI is GPL-3.0: nothing of it is in this repository. This script reads a ComfyUI git
checkout given on the command line (``git show HEAD:<path>``), executes its
``comfy/extra_samplers/uni_pc.py`` as a module and, extracted by name with ``ast``, its
``time_snr_shift``, ``reshape_sigma``, ``CONST`` and ``ModelSamplingDiscreteFlow``
(comfy/model_sampling.py) and ``simple_scheduler`` (comfy/samplers.py), then drives them the
way ComfyUI's ``KSampler`` / ``KSAMPLER`` do for a flow model under ``ModelSamplingSD3(shift)``:
the ``simple`` sigmas (for KSampler, ``steps + 1`` of them with the penultimate dropped, as
its ``DISCARD_PENULTIMATE_SIGMA_SAMPLERS`` rule does for uni_pc), ``noise_scaling``, the
sampler, ``inverse_noise_scaling`` at the schedule's last entry. The model is the toy flow
model of comfy_flow_schedules.json: velocity ``v = 0.5 * x - sigma``, denoised by CONST's
``x - v * sigma``; the start is ``linspace(-1, 1, 6)``.

    python scripts/comfy_unipc_golden.py /path/to/ComfyUI [--out tests/workflows/golden/comfy_unipc.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import types
from pathlib import Path

import torch

CASES = [(shift, steps, ksampler) for shift, steps in ((8.0, 1), (8.0, 2), (8.0, 3), (8.0, 4), (3.0, 6), (5.0, 10))
         for ksampler in (False, True)]


def source(repo: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def extract(text: str, names: set[str], namespace: dict) -> None:
    """Execute the top-level functions / classes of ``text`` named in ``names`` into ``namespace``."""
    tree = ast.parse(text)
    picked = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    missing = names - {node.name for node in picked}
    assert not missing, f"not found: {missing}"
    exec(compile(ast.Module(body=picked, type_ignores=[]), "<comfyui>", "exec"), namespace)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("comfyui", type=Path, help="a ComfyUI git checkout (its .git or work tree)")
    parser.add_argument("--out", type=Path, default=Path("tests/workflows/golden/comfy_unipc.json"))
    args = parser.parse_args()
    revision = subprocess.run(["git", "-C", str(args.comfyui), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    uni_pc = types.ModuleType("uni_pc")
    exec(compile(source(args.comfyui, "comfy/extra_samplers/uni_pc.py"), "uni_pc.py", "exec"), uni_pc.__dict__)
    ns: dict = {"torch": torch}
    extract(source(args.comfyui, "comfy/model_sampling.py"),
            {"time_snr_shift", "reshape_sigma", "CONST", "ModelSamplingDiscreteFlow"}, ns)
    extract(source(args.comfyui, "comfy/samplers.py"), {"simple_scheduler"}, ns)

    x_init = torch.linspace(-1, 1, 6)
    cases = []
    for variant, run in (("bh1", uni_pc.sample_unipc), ("bh2", uni_pc.sample_unipc_bh2)):
        for shift, steps, ksampler in CASES:
            sampling = ns["ModelSamplingDiscreteFlow"]()
            sampling.set_parameters(shift=shift)
            sigmas = ns["simple_scheduler"](sampling, steps + 1 if ksampler else steps)
            if ksampler:
                sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
            listed = sigmas.tolist()
            const = ns["CONST"]()
            noise = x_init[None]  # [1, 6]
            x = const.noise_scaling(sigmas[0], noise, torch.zeros_like(noise))

            def model(x, sigma, **kwargs):
                v = 0.5 * x - sigma.view(-1, 1)  # the toy velocity at the model input
                return const.calculate_denoised(sigma, v, x)

            out = run(model, x, sigmas, extra_args={}, callback=None, disable=True)
            out = const.inverse_noise_scaling(sigmas[-1], out)  # (sigmas[-1] as the sampler left it)
            cases.append({"variant": variant, "shift": shift, "steps": steps, "ksampler": ksampler,
                          "sigmas": listed, "x_init": x_init.tolist(), "x_final": out[0].tolist()})
    table = {"source": f"ComfyUI {revision}: comfy/extra_samplers/uni_pc.py sample_unipc / sample_unipc_bh2, "
                       "driven as KSampler / KSAMPLER do for a flow model (scripts/comfy_unipc_golden.py)",
             "unipc": cases}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
