"""End to end with the defaults, side by side in one run: what a user gets from
``VideoGenerator.from_pretrained(folder, device="cuda")`` (no kernel flags: "auto" is the
family's fast path, models/fast_path.py) vs the same flags spelled out as the old defaults
(sdpa, sequential CFG, eager), vs diffusers' ``WanPipeline`` plain and with its own
``transformer.compile_repeated_blocks()``, on one random-weight checkpoint in the diffusers
layout (Wan2.1-T2V-1.3B architecture, its real VAE; a 1-layer stand-in text encoder).

Each side runs once to warm (compile, cuDNN plans), then ``--iters`` timed runs (median).
Agreement with diffusers: PSNR and max |diff| of the decoded frames (bf16; both sides seeded
alike: the same initial noise, bit-equal in fp32 by the parity tests).

    python benchmarks/bench_defaults.py --out defaults_h100.jsonl     # GPU
    python benchmarks/bench_defaults.py --tiny                        # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from common import agreement, emit, jsonl_sink  # benchmarks/ is on sys.path when this runs as a script
from wan_random import save_random_wan

PROMPT = "a red circle moving right"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, iters: int, device: torch.device):
    out = fn()  # warm: compile, autotune, cuDNN plans
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return out, times


def _frames(video) -> torch.Tensor:
    """[F, H, W, C] float in [0, 1] from ours (uint8 frames) or diffusers' np output."""
    t = torch.as_tensor(video)
    return t.float() / 255.0 if t.dtype == torch.uint8 else t.float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="denoise steps (default 50; tiny 3)")
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--sides", default="ours_default,ours_old_defaults,diffusers,diffusers_compiled")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, w, f = (32, 32, 5) if args.tiny else (480, 832, 81)
    steps = args.steps or (3 if args.tiny else 50)
    folder = save_random_wan(size="tiny" if args.tiny else "full", device=str(device))
    base = {"bench": "defaults_e2e", "model": "wan2.1-1.3b-arch" if not args.tiny else "wan-tiny",
            "shape": [h, w, f], "steps": steps, "guidance": args.guidance, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    results: dict[str, tuple[torch.Tensor, list[float]]] = {}
    sides = args.sides.split(",")
    with jsonl_sink(args.out) as sink:
        for side in (s for s in sides if s.startswith("ours")):
            from omniloop.api.generator import VideoGenerator

            flags = {} if side == "ours_default" else {"attention_backend": "sdpa", "cfg_mode": "sequential",
                                                        "compile": False}
            gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype=str(dtype).removeprefix("torch."),
                                                 **flags)

            def run(gen=gen):
                return gen.generate_video(PROMPT, height=h, width=w, num_frames=f, num_inference_steps=steps,
                                          guidance_scale=args.guidance, seed=0, save_video=False).frames

            frames, times = _timed(run, args.iters, device)
            results[side] = (_frames(frames), times)
            emit({**base, "side": side, "flags": flags or "defaults", "median_s": round(statistics.median(times), 3),
                  "times_s": [round(t, 3) for t in times]}, sink)
            del gen
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for side in (s for s in sides if s.startswith("diffusers")):
            from diffusers import WanPipeline

            pipe = WanPipeline.from_pretrained(folder, torch_dtype=dtype).to(device)
            pipe.set_progress_bar_config(disable=True)
            if side == "diffusers_compiled":
                pipe.transformer.compile_repeated_blocks(fullgraph=True)

            def run(pipe=pipe):
                g = torch.Generator("cpu").manual_seed(0)  # ours draws the initial noise on the CPU (the parity tests)
                return pipe(PROMPT, height=h, width=w, num_frames=f, num_inference_steps=steps,
                            guidance_scale=args.guidance, generator=g, output_type="np").frames[0]

            frames, times = _timed(run, args.iters, device)
            results[side] = (_frames(frames), times)
            emit({**base, "side": side, "median_s": round(statistics.median(times), 3),
                  "times_s": [round(t, 3) for t in times]}, sink)
            del pipe
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "diffusers" in results:
            ref = results["diffusers"][0]
            for side, (frames, times) in results.items():
                if side != "diffusers" and frames.shape == ref.shape:
                    emit({**base, "side": side, "metric": "agreement_vs_diffusers", **agreement(frames, ref)}, sink)
        if "ours_default" in results and "diffusers_compiled" in results:
            emit({**base, "metric": "speedup_ours_default_over_diffusers_compiled",
                  "value": round(statistics.median(results["diffusers_compiled"][1])
                                 / statistics.median(results["ours_default"][1]), 3)}, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
