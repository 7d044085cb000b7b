"""Cache acceleration on the Wan architecture: speed-up vs quality, and hook overhead
(JSON lines).

  cache     DBCache / FBCache / DBCache+TaylorSeer / TaylorSeer (step) / TeaCache, >= 3
            settings each: denoise wall time vs the uncached run (speed-up), share of
            branch forwards served from cache, PSNR / SSIM of the decoded video and PSNR of
            the latents against the uncached output of the same seed.
  overhead  step time with no plugins (baseline) vs plugins installed but unused on the hot
            path, vs an interceptor turned off per request, vs caching configured off, vs a
            step-level observer: "an unused hook point costs nothing".

    python benchmarks/bench_cache.py                 # GPU: Wan2.1-T2V-1.3B architecture (random weights)
    python benchmarks/bench_cache.py --cpu-small     # CPU: an 8-block small Wan (ratios only)
    python benchmarks/bench_cache.py --tiny          # CPU smoke test (seconds)
    python benchmarks/bench_cache.py --checkpoint shapes-t2v --size 128 128 --frames 17 --steps 50 \
        --adherence 256                              # the shapes model: + adherence per setting
    python benchmarks/bench_cache.py --cpu --checkpoint shapes-t2v --size 128 128 --frames 17 --steps 50 \
        --adherence 200 --methods taylorseer teacache --settings 1   # the same on the CPU, a subset

NOTE: the weights are random. Residual and timestep-embedding statistics of a random DiT
are not those of a trained one, so the cache decisions (hence speed-up and PSNR) are not
predictive of a real checkpoint; fixed published thresholds may cache everything or
nothing. Each method therefore also runs at thresholds calibrated on this model (quantiles
of the decision statistic observed in a calibration run), which spans its speed/quality
curve; TeaCache's published rescale polynomials are fitted to trained Wan weights, so the
calibrated TeaCache runs use the identity rescale. Point --checkpoint at a real Wan2.1
checkpoint (diffusers layout) for meaningful numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, fill_unset  # noqa: E402
from wan_random import save_random_wan  # noqa: E402
from omniloop.engine import Engine, EngineConfig  # noqa: E402
from omniloop.ext import install_plugins  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart  # noqa: E402

METHODS = ("fbcache", "dbcache", "dbcache+taylorseer", "taylorseer", "teacache")
RANDOM_WEIGHTS_NOTE = (
    "random weights: residual / timestep-embedding statistics differ from a trained model, so cache decisions, "
    "speed-ups and PSNR here are not predictive of a real checkpoint; compare settings relative to each other"
)


# -- quality ---------------------------------------------------------------------------------


QUALITY_DEVICE = torch.device("cpu")  # where PSNR/SSIM are computed (the pipeline's device; see main)


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float) -> float:
    x, ref = x.to(QUALITY_DEVICE), ref.to(QUALITY_DEVICE)
    mse = F.mse_loss(x.double(), ref.double()).item()
    return float("inf") if mse == 0 else 10 * math.log10(data_range**2 / mse)


def ssim(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean SSIM over frames and channels; uint8 video [F, H, W, 3] (11x11 Gaussian, sigma 1.5)."""
    a = x.to(QUALITY_DEVICE).permute(0, 3, 1, 2).float() / 255.0
    b = ref.to(QUALITY_DEVICE).permute(0, 3, 1, 2).float() / 255.0
    coords = torch.arange(11, dtype=torch.float32, device=QUALITY_DEVICE) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = (g / g.sum())[:, None] * (g / g.sum())[None, :]
    win = g.expand(3, 1, 11, 11).contiguous()
    pad = min(5, a.shape[-1] // 2, a.shape[-2] // 2)
    win = win[..., 5 - pad : 6 + pad, 5 - pad : 6 + pad]
    win = win / win.sum(dim=(-1, -2), keepdim=True)

    def blur(t):
        return F.conv2d(t, win, groups=3)

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.mean().item()


# -- runs ---------------------------------------------------------------------------------------


def make_request(args, rid: str, plugin_params: dict | None = None, steps: int | None = None) -> OmniRequest:
    h, w = args.size
    return OmniRequest(
        task=TaskType.T2V, request_id=rid, inputs=[TextPart(text="a red circle moving right")],
        outputs=OutputSpec(return_latents=True),
        diffusion=DiffusionParams(steps=steps or args.steps, height=h, width=w, num_frames=args.frames, seed=args.seed,
                                  guidance_scale=args.guidance, plugin_params=plugin_params or {}),
    )


class MemoText:
    """Text encodings memoized by prompt: every run encodes the same prompt and only the
    denoise node is timed, so encode once."""

    def __init__(self, encoder: Any) -> None:
        self.encoder, self.memo = encoder, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.encoder, name)

    def encode(self, prompts, *, device=None):
        key = (tuple(prompts), str(device))
        if key not in self.memo:
            self.memo[key] = self.encoder.encode(prompts, device=device)
        return self.memo[key]


CLOCK = time.perf_counter  # CPU modes: time.thread_time (see main)


def run_one(pipeline, request: OmniRequest) -> tuple[Any, dict, float]:
    """Run ``request`` through the engine; returns (output, plugin metrics, seconds spent in
    denoise steps). The engine syncs CUDA after every step, so wall time covers GPU work."""
    engine = Engine(pipeline, EngineConfig(max_queue=16))
    step_s = 0.0
    with torch.inference_mode():
        rid = engine.add_request(request)
        while engine.has_unfinished():
            steps, t0 = engine.stats.steps, CLOCK()
            engine.step()
            if engine.stats.steps > steps:
                step_s += CLOCK() - t0
    out = engine.pop_output(rid)
    assert out.status.value == "completed", out.error
    return out, engine.plugin_metrics(), step_s


def timed(pipeline, request: OmniRequest, repeats: int) -> tuple[Any, dict, float]:
    """``run_one`` ``repeats`` times (same seed, same output); the fastest denoise time."""
    runs = [run_one(pipeline, request.model_copy(update={"request_id": f"{request.request_id}#{i}"}))
            for i in range(repeats)]
    out, metrics, _ = runs[0]
    return out, metrics, min(r[2] for r in runs)


def warmup_steps(steps: int) -> int:
    return 8 if steps >= 40 else max(2, steps // 5)


def calibrate(base, args, plugins: dict) -> dict:
    """Decision statistics of one run that never caches (threshold ~ 0)."""
    pipe = install_plugins(base, plugins)
    _, metrics, _ = run_one(pipe, make_request(args, f"calibrate-{next(iter(plugins))}"))
    return metrics[next(iter(plugins))].get("stat_quantiles", {})


def settings(base, args, n_blocks: int) -> list[tuple[str, str, dict]]:
    """(method, label, plugins) — published defaults plus thresholds calibrated on this model."""
    w = warmup_steps(args.steps)
    fn = 8 if n_blocks >= 16 else max(1, n_blocks // 4)
    fn_small, bn_small = (4, 4) if n_blocks >= 16 else (1, 1 if n_blocks > 2 else 0)
    out: list[tuple[str, str, dict]] = []

    wanted = set(args.methods or METHODS)  # a calibration run only for a method that will run

    def calibrated(methods: set[str], plugins: dict) -> dict:
        return calibrate(base, args, plugins) if wanted & methods else {}

    q_fb = calibrated({"fbcache"}, {"fbcache": {"threshold": 1e-9, "warmup_steps": w}})
    q_db = calibrated({"dbcache", "dbcache+taylorseer"},
                      {"dbcache": {"Fn": fn, "Bn": 0, "threshold": 1e-9, "warmup_steps": w}})
    q_tea = calibrated({"teacache"}, {"teacache": {"model": "identity", "threshold": 1e-12, "ret_steps": w // 2 + 1}})

    def quantile(q: dict, key: float, fallback: float) -> float:
        return round(float(q.get(key, q.get(str(key), fallback))), 5)

    for label, thr in (("r0.08 (cache-dit default)", 0.08), ("calibrated p50", quantile(q_fb, 0.5, 0.1)),
                       ("calibrated p90", quantile(q_fb, 0.9, 0.2))):
        out.append(("fbcache", f"F1B0 {label}", {"fbcache": {"threshold": thr, "warmup_steps": w}}))
    for label, thr, extra in (("r0.08 (cache-dit F8B0)", 0.08, {}),
                              ("calibrated p50", quantile(q_db, 0.5, 0.1), {}),
                              ("calibrated p90 max-continuous 3", quantile(q_db, 0.9, 0.2), {"max_continuous_cached_steps": 3})):
        out.append(("dbcache", f"F{fn}B0 {label}", {"dbcache": {"Fn": fn, "Bn": 0, "threshold": thr, "warmup_steps": w, **extra}}))
    if fn_small + bn_small < n_blocks:
        thr = quantile(q_db, 0.9, 0.2)
        out.append(("dbcache", f"F{fn_small}B{bn_small} calibrated p90",
                    {"dbcache": {"Fn": fn_small, "Bn": bn_small, "threshold": thr, "warmup_steps": w}}))
    for order, q in ((1, 0.75), (1, 0.9), (2, 0.9)):
        thr = quantile(q_db, q, 0.2)
        out.append(("dbcache+taylorseer", f"F{fn}B0 calibrated p{int(q * 100)} TaylorSeer O{order}",
                    {"dbcache": {"Fn": fn, "Bn": 0, "threshold": thr, "warmup_steps": w, "taylorseer_order": order}}))
    for interval, order in ((2, 1), (3, 1), (3, 2)):
        out.append(("taylorseer", f"step forecast warmup {w} interval {interval} O{order}",
                    {"taylorseer": {"warmup_steps": w, "interval": interval, "order": order}}))
    med = quantile(q_tea, 0.5, 0.05)
    for k in (1.5, 3.0, 6.0):
        out.append(("teacache", f"identity rescale, threshold {k} x median distance",
                    {"teacache": {"model": "identity", "threshold": round(k * med, 6), "ret_steps": w // 2 + 1}}))
    out.append(("teacache", "Wan2.1-1.3B polynomial, threshold 0.2 (published)",
                {"teacache": {"model": "wan2.1-t2v-1.3b", "threshold": 0.2, "ret_steps": 5}}))
    return out


def selected(all_settings: list[tuple[str, str, dict]], args) -> list[tuple[str, str, dict]]:
    """``--methods`` (all when empty), then per method the ``--settings`` positions (1-based)
    or else the first ``--max-settings``."""
    out, seen = [], {}
    for method, label, plugins in all_settings:
        if args.methods and method not in args.methods:
            continue
        seen[method] = seen.get(method, 0) + 1
        if args.settings:
            if seen[method] not in args.settings:
                continue
        elif args.max_settings is not None and seen[method] > args.max_settings:
            continue
        out.append((method, label, plugins))
    return out


def bench_cache(base, args, base_rec: dict, sink) -> None:
    n_blocks = len(base.components["transformer"].blocks)
    run_one(base, make_request(args, "warmup", steps=2 * warmup_steps(args.steps)))  # kernels, allocator
    ref, _, ref_s = timed(base, make_request(args, "uncached"), args.repeats)
    ref_video, ref_lat = ref.video.frames, ref.artifacts["latents"].latents.float()
    lat_range = (ref_lat.max() - ref_lat.min()).item()
    emit({**base_rec, "bench": "cache", "method": "none", "setting": "uncached", "denoise_s": round(ref_s, 4),
          "speedup": 1.0, "skip_ratio": 0.0}, sink)
    for method, label, plugins in selected(settings(base, args, n_blocks), args):
        pipe = install_plugins(base, plugins)
        out, metrics, s = timed(pipe, make_request(args, f"{method}:{label}"), args.repeats)
        name = next(iter(plugins))
        emit({**base_rec, "bench": "cache", "method": method, "setting": label, "config": plugins[name],
              "denoise_s": round(s, 4), "speedup": round(ref_s / s, 3),
              "skip_ratio": metrics[name]["skip_ratio"],
              "psnr": round(psnr(out.video.frames, ref_video, 255.0), 2),
              "ssim": round(ssim(out.video.frames, ref_video), 4),
              "latent_psnr": round(psnr(out.artifacts["latents"].latents.float(), ref_lat, lat_range), 2)}, sink)


def bench_adherence(base, args, base_rec: dict, sink) -> None:
    """Adherence (color / shape / motion) of ``args.adherence`` held-out shapes-world prompts,
    uncached vs each cache setting, plus the mean PSNR of each video against its uncached
    twin (same seed). Requests run batched through one engine; the speed-ups are the
    ``cache`` bench's (one request at a time)."""
    from omniloop.eval.adherence import evaluate
    from omniloop.eval.shapes_world import held_out_prompts
    from omniloop.train.recipes.rollout import run_requests, t2v_request

    h, w = args.size
    prompts = held_out_prompts(args.adherence, seed=0)

    def generate(pipe) -> list[torch.Tensor]:
        requests = [t2v_request(p.prompt, seed=i, steps=args.steps, height=h, width=w, num_frames=args.frames,
                                guidance_scale=args.guidance) for i, p in enumerate(prompts)]
        return [o.video.frames for o in run_requests(pipe, requests, max_batch=args.adherence_batch)]

    def record(method: str, label: str, frames: list[torch.Tensor], ref: list[torch.Tensor] | None) -> None:
        report = evaluate(zip([f.cpu().numpy() for f in frames], [p.prompt for p in prompts]))
        rec = {**base_rec, "bench": "cache_adherence", "method": method, "setting": label, "prompts": len(prompts),
               **{k: round(report.accuracy(k), 4) for k in ("color", "shape", "motion")},
               "all_correct": round(report.clip_accuracy, 4)}
        if ref is not None:
            rec["mean_psnr"] = round(statistics.fmean(min(psnr(a, b, 255.0), 100.0) for a, b in zip(frames, ref)), 2)
        emit(rec, sink)

    ref = generate(base)
    record("none", "uncached", ref, None)
    for method, label, plugins in selected(settings(base, args, len(base.components["transformer"].blocks)), args):
        record(method, label, generate(install_plugins(base, plugins)), ref)


def bench_overhead(base, args, base_rec: dict, sink) -> None:
    """Mean denoise step time per variant, rounds interleaved; median over rounds."""
    plain_plugins = {"dbcache": {"Fn": 1, "threshold": 0.1}}
    variants = {
        "baseline (no plugins)": (base, None),
        "plugins installed, no hot-path subscriber": (
            install_plugins(base, {"activation_trace": {"taps": "matches-no-module"}}), None),
        "block interceptor off for the request": (
            install_plugins(base, plain_plugins), {"dbcache": {"enabled": False}}),
        "caching configured off (threshold 0)": (
            install_plugins(base, {"dbcache": {"Fn": 1, "threshold": 0.0}}), None),
        "profiler (step hooks, no block taps)": (install_plugins(base, {"profiler": {"blocks": False}}), None),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    size, frames = args.overhead_shape
    for r in range(args.overhead_rounds):
        for name, (pipe, params) in variants.items():
            req = OmniRequest(task=TaskType.T2V, request_id=f"ovh-{r}-{len(times[name])}",
                              inputs=[TextPart(text="a red circle")],
                              diffusion=DiffusionParams(steps=args.overhead_steps, height=size, width=size,
                                                        num_frames=frames, seed=0, guidance_scale=1.0,
                                                        plugin_params=params or {}))
            _, _, step_s = run_one(pipe, req)
            times[name].append(step_s / args.overhead_steps)
    if args.overhead_rounds > 2:  # round 0 is warm-up (allocator, cuDNN autotune): measured, not counted
        times = {name: ts[1:] for name, ts in times.items()}
    base_t = statistics.median(times["baseline (no plugins)"])
    spread = (max(times["baseline (no plugins)"]) - min(times["baseline (no plugins)"])) / base_t
    for name, ts in times.items():
        t = statistics.median(ts)
        emit({**base_rec, "bench": "hook_overhead", "variant": name, "shape": [size, size, frames],
              "steps": args.overhead_steps, "rounds": args.overhead_rounds, "step_s": round(t, 6),
              "overhead_pct": round(100 * (t / base_t - 1), 2), "baseline_spread_pct": round(100 * spread, 2)}, sink)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="CPU smoke test: 2-block toy Wan, few steps")
    mode.add_argument("--cpu-small", action="store_true", help="CPU: 8-block small Wan")
    mode.add_argument("--cpu", action="store_true", help="CPU with --checkpoint (e.g. the shapes model)")
    p.add_argument("--checkpoint", help="a Wan checkpoint (diffusers layout, or a built-in name such as "
                   "shapes-t2v) instead of random weights")
    p.add_argument("--adherence", type=int, default=0, metavar="N",
                   help="also score N held-out shapes-world prompts per setting (a shapes checkpoint)")
    p.add_argument("--adherence-batch", type=int, default=16, help="requests per batched step in the adherence runs")
    p.add_argument("--size", type=int, nargs=2, metavar=("H", "W"))
    p.add_argument("--frames", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-shape", type=int, nargs=2, metavar=("SIZE", "FRAMES"))
    p.add_argument("--overhead-steps", type=int)
    p.add_argument("--overhead-rounds", type=int)
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--threads", type=int, default=1, help="CPU modes: torch threads")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="CPU modes: time steps by this thread's CPU time (default; needs --threads 1) or wall time")
    p.add_argument("--repeats", type=int, help="runs per setting (fastest counts); default 1 on GPU, 3 on CPU")
    p.add_argument("--max-settings", type=int, default=None, help="at most N settings per method (smoke tests)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=[], help="only these methods (default: all)")
    p.add_argument("--settings", type=int, nargs="+", default=[], metavar="K",
                   help="only the K-th settings (1-based) of each method")
    p.add_argument("--skip", choices=["cache", "overhead", "adherence"], action="append", default=[])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    if args.cpu and not args.checkpoint:
        sys.exit("--cpu runs a --checkpoint on the CPU; without one pass --cpu-small or --tiny")
    gpu = not (args.tiny or args.cpu_small or args.cpu)
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --cpu-small or --tiny for the CPU modes")
    device = torch.device("cuda" if gpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: torch.bfloat16 if gpu else torch.float32}[args.dtype]
    global QUALITY_DEVICE
    QUALITY_DEVICE = device
    size_name = "tiny" if args.tiny else "small" if args.cpu_small or args.cpu else "full"
    defaults = {
        # overhead at 384x384x9 (~0.1 s/step): at 256x256x1 (32 ms/step, launch-bound) the H200 run's
        # baseline spread was 61% (first round included), too noisy to bound a 1% overhead
        "full": dict(size=[480, 832], frames=33, steps=50, repeats=1, overhead_shape=[384, 9], overhead_steps=20,
                     overhead_rounds=6),
        "small": dict(size=[128, 128], frames=9, steps=30, repeats=3, overhead_shape=[64, 1], overhead_steps=30,
                      overhead_rounds=5),
        "tiny": dict(size=[32, 32], frames=5, steps=10, repeats=1, overhead_shape=[32, 1], overhead_steps=10,
                     overhead_rounds=2),
    }[size_name]
    fill_unset(args, defaults)
    if not gpu:
        torch.set_num_threads(args.threads)
        if args.clock == "cpu":
            global CLOCK
            CLOCK = time.thread_time  # compute time of this (the only compute) thread: robust to a busy machine

    folder = args.checkpoint
    if folder is None:
        folder = save_random_wan(Path(tempfile.mkdtemp(prefix="wan_cache_bench_")), size=size_name,
                                 device="cuda" if gpu else "cpu")
    base = load_pipeline(folder, LoadOptions(device=device, dtype=dtype))[1]
    base.components["text_encoder"] = MemoText(base.components["text_encoder"])
    arch = base.components["transformer"].config
    base_rec = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": str(dtype).removeprefix("torch."),
        "arch": f"Wan {arch.num_layers} blocks x {arch.inner_dim}", "weights": "checkpoint" if args.checkpoint else "random",
        "shape": [*args.size, args.frames], "steps": args.steps, "guidance": args.guidance,
        "clock": "wall (CUDA-synced per step)" if gpu else f"{args.clock} ({args.threads} thread(s))",
    }
    sink = open(args.out, "w") if args.out else None
    if args.checkpoint is None:
        emit({**base_rec, "bench": "note", "note": RANDOM_WEIGHTS_NOTE}, sink)
    t0 = time.perf_counter()
    if "cache" not in args.skip:
        bench_cache(base, args, base_rec, sink)
    if args.adherence and "adherence" not in args.skip:
        bench_adherence(base, args, base_rec, sink)
    if "overhead" not in args.skip:
        bench_overhead(base, args, base_rec, sink)
    emit({**base_rec, "bench": "done", "wall_s": round(time.perf_counter() - t0, 1)}, sink)


if __name__ == "__main__":
    main()
