"""Our DenoiseLoop step vs diffusers' Wan transformer forward, side by side in one run.

Identical random weights (diffusers' WanTransformer3DModel, seeded, converted to ours by
the checkpoint key mapping), identical inputs. Eager and compiled, plus VAE decode.
Prints one JSON line per measurement (and writes them to --out).

    python benchmarks/bench_wan_step.py                 # H200: Wan2.1-1.3B at 480x832x81
    python benchmarks/bench_wan_step.py --tiny          # CPU smoke (what CI runs)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from common import emit, jsonl_sink, profile_top, timed  # benchmarks/ is on sys.path when this runs as a script
from omniloop.models.families.wan.presets import WAN21_T2V_1_3B, WAN21_T2V_14B
from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.models.layers.attention import set_attention_backend


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    frames: int
    text_len: int = 512

    @property
    def latent(self) -> tuple[int, int, int]:
        return ((self.frames - 1) // 4 + 1, self.height // 8, self.width // 8)

    def tokens(self, patch=(1, 2, 2)) -> int:
        f, h, w = self.latent
        return f // patch[0] * (h // patch[1]) * (w // patch[2])


EXACT_BACKENDS = ("sdpa", "sdpa_cudnn", "sdpa_flash")  # bf16 kernels: no error of their own to report


def dit_flops(cfg: dict, shape: Shape) -> float:
    """Matmul FLOPs of one forward (2 per multiply-add)."""
    L, Lt, D, F = shape.tokens(), shape.text_len, cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    per_layer = 2 * (4 * L * D * D + 2 * L * L * D + 2 * L * D * D + 2 * Lt * D * D + 2 * L * Lt * D + 2 * L * D * F)
    return cfg["num_layers"] * per_layer




def build_models(cfg: dict, device, dtype, *, reference: bool = True):
    """Both models loaded the way users load them, from one saved random checkpoint:
    diffusers ``from_pretrained(torch_dtype=...)`` and our ``load_wan_dit`` (both keep the
    same modules in fp32)."""
    import tempfile

    from diffusers import WanTransformer3DModel

    folder = tempfile.mkdtemp(prefix="wan_bench_")
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes
        WanTransformer3DModel(**cfg).save_pretrained(folder)
    ref = (WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval().requires_grad_(False)
           if reference else None)
    ours = load_wan_dit(folder, device=device, dtype=dtype).eval().requires_grad_(False)
    if not reference:  # nothing reloads it (the FP8 runs need the reference): a 14B checkpoint is 57 GB of disk
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return ref, ours, folder


def our_loop(ours, shape: Shape, text: torch.Tensor, device, dtype, guidance: float, cfg_mode: str):
    """A real DenoiseLoop (Wan adapter, UniPC sampler) bound to ``ours``; returns (stage, ctx, loop)."""
    from omniloop.models.families.wan.stages import WanDenoiser
    from omniloop.pipeline.edges import TextEmbeddings
    from omniloop.pipeline.loops.denoise import DenoiseLoop
    from omniloop.pipeline.pipeline import Pipeline
    from omniloop.pipeline.policies.cfg import ClassicCFG
    from omniloop.pipeline.samplers import build_sampler
    from omniloop.pipeline.samplers.sampler_set import SamplerSet
    from types import SimpleNamespace

    from omniloop.models.autoencoders.wan_vae import WanVAEConfig
    from omniloop.pipeline.defaults import GenerationDefaults
    from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
    from omniloop.pipeline.stage import StageBase
    from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

    class GivenText(StageBase):
        outputs = {"text": TextEmbeddings}

        def forward(self, ctx, state):
            ctx.write(state, "text", TextEmbeddings(prompt=text, negative=text.flip(1)))

    sampler = build_sampler("flow_unipc", {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0})
    spec = PipelineSpec(
        name="bench", family="wan", tasks=frozenset({TaskType.T2V}),
        components={"transformer": ComponentSpec(name="transformer", kind="dit"), "sampler": ComponentSpec(name="sampler", kind="s")},
        nodes=(Node("text", GivenText()), Node("denoise", DenoiseLoop(WanDenoiser(), cfg=ClassicCFG(cfg_mode)))),
        outputs={},
    )
    defaults = GenerationDefaults(steps=1000, guidance_scale=guidance, height=shape.height, width=shape.width,
                                  num_frames=shape.frames, fps=16)
    # the latent grid is the VAE's (Wan2.1: z_dim 16, 4x temporal, 8x spatial): its config, no weights
    vae = SimpleNamespace(config=WanVAEConfig())
    pipe = Pipeline(spec=spec, components={"transformer": ours, "vae": vae,
                                           "sampler": SamplerSet.single("flow_unipc", sampler)},
                    device=device, dtype=dtype, defaults=defaults)
    state = pipe.admit(OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="x")], diffusion=DiffusionParams(seed=0)))
    pipe.spec.node("text").stage.forward(pipe.contexts["text"], state)
    stage, ctx = pipe.spec.node("denoise").stage, pipe.contexts["denoise"]
    return stage, ctx, stage.init(ctx, state)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_dit(args, cfg, shape, device, dtype, sink):
    cuda = device.type == "cuda"
    ref, ours, folder = build_models(cfg, device, dtype, reference=args.diffusers)
    f, h, w = shape.latent
    g = torch.Generator("cpu").manual_seed(0)
    x = torch.randn(1, cfg["in_channels"], f, h, w, generator=g).to(device, dtype)
    text = torch.randn(1, shape.text_len, cfg["text_dim"], generator=g).to(device, dtype)
    t = torch.tensor([500.0], device=device)
    flops = dit_flops(cfg, shape)
    base = {"bench": "wan_dit", "tokens": shape.tokens(), "shape": [shape.height, shape.width, shape.frames],
            "dtype": str(dtype).removeprefix("torch."), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "tflop_per_forward": round(flops / 1e12, 2), "arch": args.arch}

    with torch.inference_mode():
        # numerical agreement on these exact inputs (bf16: both accumulate differently)
        b = ours(x, t, text)
        if ref is None:  # --no-diffusers: our step alone (a model too large to hold twice, or timed alone)
            return bench_ours_alone(args, ours, shape, text, device, dtype, base, sink)
        a = ref(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        emit({**base, "metric": "rel_l2_ours_vs_diffusers", "value": _rel(b, a)}, sink)

        results = {}

        def record(name, fn, forwards=1, iters=args.iters):
            times = timed(fn, warmup=args.warmup, iters=iters, cuda=cuda)
            med = statistics.median(times)
            results[name] = med
            emit({**base, "metric": name, "median_s": med, "min_s": min(times), "iters": len(times),
                  "tflops": round(forwards * flops / med / 1e12, 1)}, sink)

        def profile(name: str, fn) -> None:  # --profile: the top kernels of fn, one JSON line each
            for row in profile_top(fn, cuda=cuda):
                emit({**base, "metric": f"profile[{name}]", **row}, sink)

        def diffusers_call(model):
            return lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)

        record("diffusers_forward_eager", diffusers_call(ref))
        if args.profile and not args.compile:
            profile("diffusers_forward_eager", diffusers_call(ref))
        for backend in args.backends:
            set_attention_backend(ours, backend)
            if backend not in EXACT_BACKENDS:  # a kernel that changes the numbers
                emit({**base, "metric": f"rel_l2_ours[{backend}]_vs_diffusers", "value": _rel(ours(x, t, text), a)}, sink)
            record(f"ours_forward_eager[{backend}]", lambda: ours(x, t, text))
            stage, ctx, loop = our_loop(ours, shape, text, device, dtype, 1.0, "sequential")
            record(f"ours_step_eager[{backend}]", lambda: stage.step(ctx, loop))

        if args.compile:
            ref_c = torch.compile(ref)
            record("diffusers_forward_compiled", diffusers_call(ref_c))
            if args.profile:  # now, while its compiled graph is warm (later dynamo resets drop it)
                profile("diffusers_forward_compiled", diffusers_call(ref_c))
            del ref_c
            for block in ours.blocks:
                block.compile()
            for backend in args.backends:
                set_attention_backend(ours, backend)
                torch._dynamo.reset()
                if backend not in EXACT_BACKENDS:  # the compiled kernel's error (Inductor fuses its preparation)
                    emit({**base, "metric": f"rel_l2_ours_compiled[{backend}]_vs_diffusers",
                          "value": _rel(ours(x, t, text), a)}, sink)
                stage, ctx, loop = our_loop(ours, shape, text, device, dtype, 1.0, "sequential")
                record(f"ours_step_compiled[{backend}]", lambda: stage.step(ctx, loop))
            best = args.backends[-1]
            set_attention_backend(ours, best)
            for mode in ("sequential", "batched") if args.cfg else ():
                stage, ctx, loop = our_loop(ours, shape, text, device, dtype, 5.0, mode)
                record(f"ours_step_cfg_{mode}_compiled[{best}]", lambda: stage.step(ctx, loop), forwards=2,
                       iters=max(2, args.iters // 2))
            ref_time = results["diffusers_forward_compiled"]
            for name, value in results.items():
                if name.startswith("ours_step_compiled"):
                    emit({**base, "metric": f"ratio_{name}_over_diffusers_compiled", "value": round(value / ref_time, 3)}, sink)
            if args.autotune:  # GEMM autotuning: long compile, kept last so earlier numbers survive a timeout
                torch._dynamo.reset()
                for block in ours.blocks:
                    block.compile(mode="max-autotune-no-cudagraphs")
                stage, ctx, loop = our_loop(ours, shape, text, device, dtype, 1.0, "sequential")
                record(f"ours_step_autotuned[{best}]", lambda: stage.step(ctx, loop))
                emit({**base, "metric": f"ratio_ours_step_autotuned[{best}]_over_diffusers_compiled",
                      "value": round(results[f"ours_step_autotuned[{best}]"] / ref_time, 3)}, sink)
        if args.profile:  # our step kernel by kernel (last backend), beside diffusers' forward above
            mode = "compiled" if args.compile else "eager"
            set_attention_backend(ours, args.backends[-1])
            stage, ctx, loop = our_loop(ours, shape, text, device, dtype, 1.0, "sequential")
            profile(f"ours_step_{mode}[{args.backends[-1]}]", lambda: stage.step(ctx, loop))
        if args.fp8:  # e4m3 block GEMMs (DeployConfig.quantization="fp8"/"fp8_tensor"): speed and error vs bf16
            import re

            from omniloop.models.families.wan.spec import BLOCK_GEMMS
            from omniloop.models.layers.fp8_linear import quantize_linears_

            ours = None  # frees the bf16 copy: each scaling quantizes a fresh one, the way loading does
            for scaling in args.fp8.split(","):
                quantized = load_wan_dit(folder, device=device, dtype=dtype).eval().requires_grad_(False)
                quantize_linears_(quantized, lambda name, _: re.match(BLOCK_GEMMS, name) is not None, scaling)
                if args.compile:
                    for block in quantized.blocks:
                        block.compile()
                tag = "" if scaling == "row" else f"_{scaling}"
                for backend in args.backends:
                    set_attention_backend(quantized, backend)
                    torch._dynamo.reset()  # compiled blocks (if any) recompile around the new layers
                    q = quantized(x, t, text)
                    emit({**base, "metric": f"rel_l2_ours_fp8{tag}[{backend}]_vs_ours_bf16", "value": _rel(q, b)}, sink)
                    emit({**base, "metric": f"rel_l2_ours_fp8{tag}[{backend}]_vs_diffusers_bf16", "value": _rel(q, a)},
                         sink)
                    name = f"ours_step_{'compiled' if args.compile else 'eager'}_fp8{tag}[{backend}]"
                    stage, ctx, loop = our_loop(quantized, shape, text, device, dtype, 1.0, "sequential")
                    record(name, lambda: stage.step(ctx, loop))
                    if args.profile and backend == args.backends[-1]:
                        profile(name, lambda: stage.step(ctx, loop))
                    if args.compile:
                        emit({**base, "metric": f"ratio_{name}_over_diffusers_compiled",
                              "value": round(results[name] / results["diffusers_forward_compiled"], 3)}, sink)
                del quantized, stage, ctx, loop
                if cuda:
                    torch.cuda.empty_cache()
    del ref, ours
    if cuda:
        torch.cuda.empty_cache()


def bench_ours_alone(args, ours, shape, text, device, dtype, base, sink) -> None:
    """Our step, compiled per block with the last backend (the best): one forward and a
    batched-CFG step (two forwards), as a served request runs them."""
    cuda = device.type == "cuda"
    best = args.backends[-1]
    set_attention_backend(ours, best)
    if args.compile:
        for block in ours.blocks:
            block.compile()
    mode = "compiled" if args.compile else "eager"
    cases = [(f"ours_step_{mode}[{best}]", 1.0, "sequential", 1)]
    if args.cfg:
        cases.append((f"ours_step_cfg_batched_{mode}[{best}]", 5.0, "batched", 2))
    flops = base["tflop_per_forward"] * 1e12
    for name, guidance, cfg_mode, forwards in cases:
        stage, ctx, loop = our_loop(ours, shape, text, device, dtype, guidance, cfg_mode)
        times = timed(lambda: stage.step(ctx, loop), warmup=args.warmup, iters=args.iters, cuda=cuda)
        med = statistics.median(times)
        emit({**base, "metric": name, "median_s": med, "min_s": min(times), "iters": len(times),
              "tflops": round(forwards * flops / med / 1e12, 1)}, sink)
    if cuda:
        emit({**base, "metric": "peak_memory_gb", "value": round(torch.cuda.max_memory_allocated() / 2**30, 2)}, sink)


def bench_vae(args, shape, device, dtype, sink):
    from wan_random import random_wan_vaes

    cuda = device.type == "cuda"
    ref, ours = random_wan_vaes(device, dtype, tiny=args.tiny)
    f, h, w = shape.latent
    z = torch.randn(1, 16, f, h, w, generator=torch.Generator("cpu").manual_seed(1)).to(device, dtype)
    base = {"bench": "wan_vae_decode", "shape": [shape.height, shape.width, shape.frames],
            "dtype": str(dtype).removeprefix("torch."), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    with torch.inference_mode():
        a = ref.decode(z, return_dict=False)[0]
        b = ours.decode(z)
        emit({**base, "metric": "max_abs_ours_vs_diffusers", "value": (a.float() - b.float()).abs().max().item()}, sink)
        for name, fn in (("diffusers_decode", lambda: ref.decode(z, return_dict=False)), ("ours_decode", lambda: ours.decode(z))):
            times = timed(fn, warmup=1, iters=max(1, args.iters // 3), cuda=cuda)
            emit({**base, "metric": name, "median_s": statistics.median(times), "iters": len(times)}, sink)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="toy sizes on CPU (smoke test)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-vae", dest="vae", action="store_false")
    p.add_argument("--autotune", action="store_true", help="also time our blocks compiled with max-autotune")
    p.add_argument("--fp8", nargs="?", const="row", default=None,
                   help="also time our step with e4m3 block GEMMs: 'row' (quantization='fp8', the default), "
                        "'tensor' (quantization='fp8_tensor') or 'row,tensor'")
    p.add_argument("--profile", action="store_true", help="also list the top kernels of our step and of diffusers'")
    p.add_argument("--no-cfg", dest="cfg", action="store_false", help="skip the two-forward CFG step timings")
    p.add_argument("--backends", default="sdpa,sdpa_cudnn", help="our attention backends to time (last = best)")
    p.add_argument("--arch", default="1.3b", choices=("1.3b", "14b"),
                   help="14b: Wan2.1-T2V-14B (one expert of Wan2.2-A14B: the same DiT, one active per step)")
    p.add_argument("--size", default="480p", choices=("480p", "720p"), help="480x832x81 or 720x1280x81")
    p.add_argument("--no-diffusers", dest="diffusers", action="store_false",
                   help="time our step alone (no diffusers model beside it)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        cfg = {**WAN21_T2V_1_3B, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 32, "num_layers": 2,
               "text_dim": 32, "freq_dim": 16}
        shape = Shape(32, 48, 9, text_len=16)
    else:
        cfg = dict(WAN21_T2V_14B if args.arch == "14b" else WAN21_T2V_1_3B)
        shape = Shape(720, 1280, 81) if args.size == "720p" else Shape(480, 832, 81)
    with jsonl_sink(args.out) as sink:
        if args.vae:  # first: quick, so its numbers survive a timeout in a long compile below
            bench_vae(args, shape, device, dtype, sink)
        bench_dit(args, cfg, shape, device, dtype, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
