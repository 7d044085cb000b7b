"""Sound figures, side by side with diffusers in one run (JSON lines):

  stable_audio  Stable Audio Open text-to-audio end to end (text encode, denoise, VAE decode):
                diffusers StableAudioPipeline vs our engine, same weights, same request; seconds
                and the waveforms' max abs difference
  ltx2          LTX-2 text-to-video with sound end to end (Gemma states, connectors, joint
                denoise with CFG + STG + modality guidance, video decode, audio decode +
                vocoder): diffusers LTX2Pipeline vs our engine; seconds and max abs differences
  fanout        our LTX-2 request with graph fan-out on vs off: the decode phase's wall time
                (video decode || audio decode + vocoder on their own CUDA streams vs one after
                the other), each decoder's own time, end-to-end seconds, and the time saved

    python benchmarks/bench_audio.py                  # H200: published architectures, random bf16 weights
    python benchmarks/bench_audio.py --tiny           # CPU smoke (CI)

The text-embedding cache is off (diffusers has none), so each run encodes its prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from audio_random import random_ltx2, random_stable_audio  # noqa: E402
from common import emit, fill_unset  # noqa: E402
from omniloop.engine import Engine, EngineConfig, NodeWork, SchedulingPolicy  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart  # noqa: E402

PROMPT = "waves crash on a beach at sunset, a dog barking in the rain"
NEGATIVE = "low quality, noise, worst quality, blurry"
DECODES = ("decode", "audio_decode")


def check_packages(only) -> None:
    """Fail before any GPU work when a figure's package is missing: Stable Audio's cosine
    DPM-solver (ours and diffusers') draws its noise with torchsde, which the GPU image lacks
    (carry its wheel and trampoline's: both pure Python)."""
    import importlib.util

    if "stable_audio" in only and importlib.util.find_spec("torchsde") is None:
        raise SystemExit("bench_audio: the stable_audio figure needs torchsde (pip install 'omniloop[audio]', or carry "
                         "torchsde-0.2.6 and trampoline-0.1.2 wheels); or pass --only ltx2 fanout")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(pipeline, request: OmniRequest, *, fan_out: bool = True):
    """One request through a fresh engine: (output, wall seconds, [(work, seconds)] per step)."""
    engine = Engine(pipeline, EngineConfig(nan_check=False, policy=SchedulingPolicy(fan_out=fan_out)))
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    steps = []
    sync(pipeline.device)
    t0 = time.perf_counter()
    rid = engine.add_request(request)
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step()
        sync(pipeline.device)
        steps.append((plans[-1].work, time.perf_counter() - s0))
    wall = time.perf_counter() - t0
    out = engine.pop_output(rid)
    assert out.status.value == "completed", out.error
    return out, wall, steps


def timed_ref(fn, device):
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def max_abs(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a, dtype=np.float32)), torch.as_tensor(np.asarray(b, dtype=np.float32))
    if a.shape != b.shape:
        return float("nan")
    return float((a - b).abs().max())


def bench_stable_audio(args, options, base, sink):
    ref, ours = random_stable_audio(args.size, options)
    ref.set_progress_bar_config(disable=True)
    dit, vae = ours.components["transformer"].config, ours.components["vae"].config
    seconds = args.sa_seconds or min(dit.sample_size * vae.hop_length / vae.sampling_rate, 47.0)

    def request(rid, steps):
        return OmniRequest(request_id=rid, task=TaskType.T2A, inputs=[TextPart(text=PROMPT)],
                           diffusion=DiffusionParams(steps=steps, seed=7, duration_s=seconds, guidance_scale=7.0,
                                                     negative_prompt=NEGATIVE),
                           outputs=OutputSpec(modalities=["audio"]))

    def diffusers(steps):
        return ref(PROMPT, negative_prompt=NEGATIVE, audio_end_in_s=seconds, num_inference_steps=steps,
                   guidance_scale=7.0, generator=torch.Generator().manual_seed(7)).audios[0]

    run_ours(ours, request("sa-warm", 2))  # kernels, allocator, cost model
    timed_ref(lambda: diffusers(2), options.device)
    ours_s, ref_s = [], []
    for i in range(args.iters):
        out, wall, _ = run_ours(ours, request(f"sa{i}", args.sa_steps))
        wave, ref_wall = timed_ref(lambda: diffusers(args.sa_steps), options.device)
        ours_s.append(wall)
        ref_s.append(ref_wall)
    o, r = statistics.median(ours_s), statistics.median(ref_s)
    emit({**base, "bench": "stable_audio", "steps": args.sa_steps, "audio_seconds": round(seconds, 3),
          "sample_rate": out.audio.sample_rate, "ours_s": round(o, 4), "diffusers_s": round(r, 4),
          "speedup": round(r / o, 3), "ours_runs_s": [round(x, 4) for x in ours_s],
          "diffusers_runs_s": [round(x, 4) for x in ref_s],
          "waveform_max_abs_diff": max_abs(out.audio.samples.float().cpu(), wave.float().cpu())}, sink)


def ltx2_request(rid, args, steps):
    return OmniRequest(request_id=rid, task=TaskType.T2VS, inputs=[TextPart(text=PROMPT)],
                       diffusion=DiffusionParams(steps=steps, seed=11, height=args.height, width=args.width,
                                                 num_frames=args.frames, negative_prompt=NEGATIVE),
                       outputs=OutputSpec(modalities=["video", "audio"]))


def bench_ltx2(ref, ours, args, options, base, sink):
    tokens = ours.defaults.max_sequence_length

    def diffusers(steps):
        return ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=args.height, width=args.width,
                   num_frames=args.frames, num_inference_steps=steps, max_sequence_length=tokens,
                   generator=torch.Generator().manual_seed(11), output_type="np", return_dict=False)

    run_ours(ours, ltx2_request("ltx-warm", args, 2))
    timed_ref(lambda: diffusers(2), options.device)
    ours_s, ref_s = [], []
    for i in range(args.iters):
        out, wall, _ = run_ours(ours, ltx2_request(f"ltx{i}", args, args.steps))
        (video, audio), ref_wall = timed_ref(lambda: diffusers(args.steps), options.device)
        ours_s.append(wall)
        ref_s.append(ref_wall)
    o, r = statistics.median(ours_s), statistics.median(ref_s)
    frames = np.round(np.asarray(video[0], dtype=np.float32) * 255)
    emit({**base, "bench": "ltx2", "steps": args.steps, "video": [args.height, args.width, args.frames],
          "sample_rate": out.audio.sample_rate, "ours_s": round(o, 4), "diffusers_s": round(r, 4),
          "speedup": round(r / o, 3), "ours_runs_s": [round(x, 4) for x in ours_s],
          "diffusers_runs_s": [round(x, 4) for x in ref_s],
          "frames_max_abs_diff_uint8": max_abs(out.video.frames.cpu().numpy(), frames),
          "waveform_max_abs_diff": max_abs(out.audio.samples.float().cpu(), audio[0].float().cpu())}, sink)


def bench_fanout(ours, args, base, sink):
    """The same request with fan-out on and off, alternating; medians over ``fanout_iters`` pairs."""
    rows: dict[bool, list[dict]] = {True: [], False: []}
    run_ours(ours, ltx2_request("fan-warm", args, 2), fan_out=True)
    for i in range(args.fanout_iters):
        for fan_out in (True, False):
            out, wall, steps = run_ours(ours, ltx2_request(f"fan{i}-{fan_out}", args, args.fanout_steps),
                                        fan_out=fan_out)
            decode = [(w, s) for w, s in steps if isinstance(w, NodeWork) and w.node in DECODES]
            rows[fan_out].append({"decode_phase_s": sum(s for _, s in decode), "e2e_s": wall,
                                  "parallel": any(w.parallel for w, _ in decode),
                                  **{f"{n}_node_s": out.metrics.node_s.get(n, 0.0) for n in DECODES}})
    med = {f: {k: statistics.median(r[k] for r in rows[f]) for k in rows[f][0] if k != "parallel"} for f in rows}
    for fan_out in (True, False):
        emit({**base, "bench": "fanout", "mode": "fan_out" if fan_out else "serial", "steps": args.fanout_steps,
              "video": [args.height, args.width, args.frames], "parallel": rows[fan_out][0]["parallel"],
              **{k: round(v, 4) for k, v in med[fan_out].items()}}, sink)
    on, off = med[True], med[False]
    emit({**base, "bench": "fanout", "mode": "saving", "decode_phase_saved_s": round(off["decode_phase_s"] - on["decode_phase_s"], 4),
          "e2e_saved_s": round(off["e2e_s"] - on["e2e_s"], 4),
          "decode_phase_ratio": round(off["decode_phase_s"] / on["decode_phase_s"], 3),
          "shorter_decoder_s": round(min(on["decode_node_s"], on["audio_decode_node_s"]), 4)}, sink)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--only", nargs="*", default=["stable_audio", "ltx2", "fanout"],
                   choices=["stable_audio", "ltx2", "fanout"])
    p.add_argument("--iters", type=int, default=None, help="timed runs per side (median)")
    p.add_argument("--sa-steps", type=int, default=None, help="Stable Audio steps (default 100, diffusers')")
    p.add_argument("--sa-seconds", type=float, default=None, help="audio length (default the model's longest)")
    p.add_argument("--steps", type=int, default=None, help="LTX-2 steps, end-to-end comparison")
    p.add_argument("--fanout-iters", type=int, default=2, help="fan-out on/off pairs (median)")
    p.add_argument("--fanout-steps", type=int, default=2, help="LTX-2 steps in the fan-out runs (decode is measured)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    check_packages(args.only)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.size = "tiny" if args.tiny else "published"
    tiny = args.tiny
    fill_unset(args, dict(iters=1, sa_steps=3, steps=2, height=64, width=64, frames=9) if tiny else
               dict(iters=1, sa_steps=100, steps=8, height=512, width=768, frames=121))
    options = LoadOptions(device=device, dtype=dtype, cfg_mode="batched", text_cache_bytes=0)
    base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "size": args.size}
    sink = args.out.open("a") if args.out else None
    try:
        with torch.inference_mode():
            if "stable_audio" in args.only:
                bench_stable_audio(args, options, base, sink)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if {"ltx2", "fanout"} & set(args.only):
                ref, ours = random_ltx2(args.size, options)
                ref.set_progress_bar_config(disable=True)
                if "ltx2" in args.only:
                    bench_ltx2(ref, ours, args, options, base, sink)
                if "fanout" in args.only:
                    bench_fanout(ours, args, base, sink)
    finally:
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    main()
