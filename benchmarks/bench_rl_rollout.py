"""RL rollout throughput: the engine (a group's steps batched) vs a private sequential loop.

The same rollouts two ways, on the same pipeline modules, for ``--groups`` G prompts x
``--group-size`` N seeded requests (Flow-GRPO's flow-matching SDE, ``flow_sde``, with per-step
log-probs, the trajectory captured, classifier-free guidance as the checkpoint serves it, the VAE
decode on: pixel rewards need the video; ``--no-decode`` skips it):

* ``engine`` -- ``group_rollout`` through an in-process ``Engine`` (``LibraryClient``, library
  mode): the scheduler runs the same-shape steps of up to ``--max-batch`` requests (default N:
  one group) as one ``step_many``, each CFG branch one forward over the whole batch;
* ``private`` -- what a trainer without a runtime writes: a Python loop over the requests, one at
  a time, calling the modules directly -- the text encoder (each prompt once, with the negative
  prompt: the rollout's own encode), the transformer through the family's ``Denoiser`` with CFG
  as served (``TextConditionedPolicy``: one forward per branch, 1 row each), the SDE step and its
  log-density (``flow_sde``'s own functions: ``sde_scalars``, ``transition_mean``,
  ``transition_log_prob``, the per-step noise seeds), then the VAE (``latents_to_unit_range``).

Both must give the same trajectories for the same seeds: the bench compares every step's
latents, the log-probs and the decoded frames, prints the differences and fails (after printing
the timings) when they exceed the tolerance. They are not bit-equal in general: a forward over
N rows and one over 1 row use other GEMM blockings (the C1 figure of docs/training.md: ~2e-7 per
step in fp32 on the CPU). At the private loop's shapes they are: the bench reruns the first 2
requests through the engine one at a time (``max_batch=1``) and checks their latents and frames
bit-equal to the private loop's, their log-probs within ``SOLO_LOGPROB_TOL`` (``solo_*`` in the
``agreement`` line; ``solo_engine_bit_equal`` says whether the log-probs are equal too; the CPU is
bit-equal throughout; ``--no-solo-check`` skips it). NOTE: on an H100 in bf16 the solo latents and
frames were bit-equal at every step while the per-step log-prob means differed by one ulp (1.2e-7
at ~1.6; ``rl_rollout_frames1_h100.jsonl``): the same ``row_mean_and_sum`` over the same values,
cause not found.

Prints JSON lines (``--out FILE`` appends them there too): per path its rollouts/s and seconds,
the engine's batch sizes (denoise ``step_many`` calls by size), peak device memory on CUDA; the
ratio; the agreement; ``forward_scaling``: one transformer forward over 1 row and over a batch
(``per_row_gain`` bounds what batching buys the denoise part); ``--profile``: the top
ops/kernels of each path. On the CPU, wall and process CPU time both (a shared box's load moves
the wall time).

    python benchmarks/bench_rl_rollout.py                          # CPU: 8-block Wan, 64x64x9, 16 steps
    python benchmarks/bench_rl_rollout.py --device cuda            # Wan2.1-1.3B, 480x832x17, 16 steps, bf16
    python benchmarks/bench_rl_rollout.py --device cuda --group-size 16 --groups 1 --frames 1,17

Text encoder: the random checkpoints of ``wan_random.py`` carry a one-layer UMT5 of the real width
(4096, 60-piece vocabulary), not UMT5-XXL (5.7B parameters, 11 GB in bf16 for a cost paid once per
prompt): both paths encode each prompt once, so the encoder is outside what is compared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, fill_unset, jsonl_sink, profile_top  # noqa: E402
from wan_random import CORPUS, SIZES, save_random_wan  # noqa: E402

from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.pipeline.loops.denoise import DenoiseLoop  # noqa: E402
from omniloop.pipeline.pipeline import Pipeline  # noqa: E402
from omniloop.pipeline.samplers.flow_sde import (FlowSDESampler, row_mean_and_sum, sde_scalars,  # noqa: E402
                                                 step_noise_seed, transition_log_prob, transition_mean)
from omniloop.pipeline.stages.decode import latents_to_unit_range, to_uint8_frames  # noqa: E402
from omniloop.train.rl import LibraryClient, PromptList, RolloutContext, RolloutSpec, group_rollout  # noqa: E402
from omniloop.train.rl.policy import TextConditionedPolicy  # noqa: E402
from omniloop.train.rl.rollout import trajectory_of  # noqa: E402
from omniloop.train.rl.trajectory import Trajectory  # noqa: E402

T = TypeVar("T")
PROMPTS = CORPUS[:3]  # one prompt per group (their tokens are in the random tokenizer's vocabulary)

# Sizes per mode (flags override). cpu: a Wan of 8 blocks of width 128 (``wan_random`` "small",
# small VAE) at a latent size that finishes in minutes on 2 shared cores; cuda: the Wan2.1-T2V-1.3B
# architecture and VAE at 480x832; 17 frames (5 latent frames, 7,800 tokens a forward): 81 frames
# (32,760 tokens) would take ~11 min for the two paths (16 rollouts x 16 steps x 2 CFG forwards of
# ~0.6 s each, twice), past one device call.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"size": "small", "dtype": "float32", "height": 64, "width": 64, "frames": "9", "steps": 16, "repeats": 3},
    "cuda": {"size": "full", "dtype": "bfloat16", "height": 480, "width": 832, "frames": "17", "steps": 16,
             "repeats": 1},
    "tiny": {"size": "tiny", "dtype": "float32", "height": 32, "width": 32, "frames": "5", "steps": 2,
             "group_size": 2, "groups": 2, "repeats": 1},
}
# Agreement tolerance on every step's latents, max |engine - private| / max |private|: batched and
# solo GEMMs round differently (fp32 on the CPU: ~1e-6 relative after 16 steps); bf16 rounds the
# velocity to 8 bits of mantissa (a guess until the GPU run measures it: the line prints the figure).
LATENT_TOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}
LOGPROB_TOL = 1e-3  # nats, per-element mean: the recorded density of a step's own sample
SOLO_LOGPROB_TOL = 1e-6  # the solo check's: a few ulps of the per-element mean (see the docstring)


@dataclass
class Rollout:
    """One request's rollout as both paths report it (CPU tensors)."""

    latents: torch.Tensor  # [S, 1, C, f, h, w] after each step
    log_probs: torch.Tensor  # [S] per-element mean
    log_prob_sums: torch.Tensor | None  # [S]
    video: torch.Tensor | None  # [F, H, W, 3] uint8


# -- the private sequential loop --------------------------------------------------------------
@dataclass
class PrivateLoop:
    """A trainer's own rollout loop over the pipeline's modules: no engine, no scheduler."""

    pipeline: Pipeline
    spec: RolloutSpec

    def __post_init__(self) -> None:
        self.policy = TextConditionedPolicy.of(self.pipeline, guidance_scale=self.spec.guidance_scale)
        sampler = self.pipeline.components["sampler"].get("flow_sde")
        assert isinstance(sampler, FlowSDESampler), f"flow_sde is a {type(sampler).__name__}"
        self.sampler = sampler
        self.noise_level = self.spec.noise_level if self.spec.noise_level is not None else sampler.noise_level
        vae = self.pipeline.components["vae"]
        st, ss = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        self.shape = (1, vae.config.z_dim, (self.spec.num_frames - 1) // st + 1, self.spec.height // ss,
                      self.spec.width // ss)

    @torch.inference_mode()
    def rollout(self, prompt: str, seed: int) -> Rollout:
        device = self.pipeline.device
        # the initial noise: a CPU generator seeded with the request's seed, fp32, then moved (diffusers' draw)
        x = torch.randn(self.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32).to(device)
        schedule = self.sampler.init_state(self.spec.steps, device=device, seed=seed)  # shift: the checkpoint's
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        traj, means, sums = [], [], []
        for k in range(self.spec.steps):
            v = self.policy(x, timesteps[k].expand(1), [prompt])  # [1, C, f, h, w] fp32, CFG as served
            s = sde_scalars(sigmas, k, self.noise_level)
            mean = transition_mean(x, v, s)
            gen = torch.Generator("cpu").manual_seed(step_noise_seed(seed, k))
            noise = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(device)
            x = mean + s.scale * noise
            # [1] each: the request's one row. The mean is the reduction's own, as the sampler records
            # it: on CUDA ``mean`` scales the sum by 1/n, which can round apart from ``sum / n``
            log_mean, log_sum = row_mean_and_sum(transition_log_prob(x, mean, s))
            traj.append(x.detach().clone())
            means.append(log_mean)
            sums.append(log_sum)
        video = None
        if self.spec.decode:
            vae = self.pipeline.components["vae"]
            video = to_uint8_frames(latents_to_unit_range(vae, x, whole=False)[0])
        return Rollout(latents=torch.stack(traj).cpu(), log_probs=torch.stack(means).flatten().cpu(),
                       log_prob_sums=torch.stack(sums).flatten().cpu(), video=video)


# -- the engine path ---------------------------------------------------------------------------
@contextlib.contextmanager
def counted_batches(sizes: Counter) -> Iterator[None]:
    """Counts the denoise loop's ``step_many`` calls by batch size (a solo ``step`` is one of 1)."""
    original = DenoiseLoop.step_many

    def step_many(self: DenoiseLoop, ctx: Any, loops: Any) -> Any:
        sizes[len(loops)] += 1
        return original(self, ctx, loops)

    setattr(DenoiseLoop, "step_many", step_many)
    try:
        yield
    finally:
        setattr(DenoiseLoop, "step_many", original)


def engine_rollouts(pipeline: Pipeline, spec: RolloutSpec, *, group_size: int, groups: int, max_batch: int,
                    seed: int) -> list[Trajectory]:
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=max_batch), prompts=PromptList(PROMPTS[:groups]),
                         group_size=group_size, groups=groups, spec=spec, seed=seed)
    return group_rollout(ctx)


def seed_of(t: Trajectory) -> int:
    assert t.seed is not None, "group_rollout seeds every request"
    return t.seed


def as_rollout(t: Trajectory) -> Rollout:
    assert t.latents is not None and t.log_probs is not None, f"trajectory of {t.prompt!r}: {t.status} {t.error}"
    return Rollout(latents=t.latents, log_probs=t.log_probs, log_prob_sums=None, video=t.video)


# -- measuring --------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    seconds: float  # wall
    cpu_seconds: float  # this process's CPU time: on a shared CPU box, what other processes' load leaves out
    peak_bytes: int | None  # peak device memory over the call (CUDA only)


def timed_peak(device: torch.device, fn: Callable[[], T]) -> tuple[T, Timing]:
    """(fn's result, its Timing)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return out, Timing(seconds, cpu, peak)


def summary(times: list[Timing], n: int, cuda: bool) -> dict[str, Any]:
    """Median wall and CPU seconds over the repeats, every run's, rollouts/s (wall) and the peak."""
    wall, cpu = statistics.median(t.seconds for t in times), statistics.median(t.cpu_seconds for t in times)
    return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            "all_seconds": [round(t.seconds, 3) for t in times],
            "all_cpu_seconds": [round(t.cpu_seconds, 3) for t in times],
            "rollouts_per_s": round(n / wall, 4), "rollouts_per_cpu_s": round(n / cpu, 4),
            "peak_device_bytes": max(t.peak_bytes or 0 for t in times) if cuda else None}


def forward_scaling(pipeline: Pipeline, spec: RolloutSpec, batch: int, iters: int = 3) -> dict[str, Any]:
    """One transformer forward (one CFG branch) over 1 row and over ``batch`` rows, median seconds
    (wall and CPU): ``batch * t1 / tN`` bounds what batching can buy the denoise part."""
    device = pipeline.device
    policy = TextConditionedPolicy.of(pipeline, guidance_scale=1.0)  # one branch a call
    shape = PrivateLoop(pipeline, spec).shape
    out: dict[str, Any] = {"metric": "forward_scaling", "batch": batch}
    for rows in (1, batch):
        x, t = torch.randn((rows, *shape[1:]), device=device), torch.full((rows,), 500.0, device=device)
        with torch.inference_mode():
            policy(x, t, [PROMPTS[0]] * rows)  # warm
            times = [timed_peak(device, lambda: policy(x, t, [PROMPTS[0]] * rows))[1] for _ in range(iters)]
        out[f"forward_s_b{rows}"] = round(statistics.median(tm.seconds for tm in times), 5)
        out[f"forward_cpu_s_b{rows}"] = round(statistics.median(tm.cpu_seconds for tm in times), 5)
    out["per_row_gain"] = round(batch * out["forward_s_b1"] / out[f"forward_s_b{batch}"], 3)
    out["per_row_gain_cpu"] = round(batch * out["forward_cpu_s_b1"] / out[f"forward_cpu_s_b{batch}"], 3)
    return out


def agreement(engine: list[Rollout], private: list[Rollout]) -> dict[str, Any]:
    lat = max(float((a.latents - b.latents).abs().max()) for a, b in zip(engine, private))
    scale = max(float(b.latents.abs().max()) for b in private)
    lp = max(float((a.log_probs - b.log_probs).abs().max()) for a, b in zip(engine, private))
    equal = all(torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
                for a, b in zip(engine, private))
    # the first step whose latents differ in any request (None: none): a kernel that rounds apart
    # shows at step 0, a cause that builds up later does not
    steps = [int(torch.nonzero((a.latents != b.latents).flatten(1).any(1))[0]) for a, b in zip(engine, private)
             if not torch.equal(a.latents, b.latents)]
    out: dict[str, Any] = {"latents_max_abs_diff": lat, "latents_rel_diff": lat / scale, "log_probs_max_abs_diff": lp,
                           "first_unequal_step": min(steps) if steps else None, "bit_equal": equal}
    videos = [(a.video, b.video) for a, b in zip(engine, private) if a.video is not None and b.video is not None]
    if videos:
        out["video_max_abs_diff_uint8"] = max(int((a.int() - b.int()).abs().max()) for a, b in videos)
        out["video_equal"] = all(torch.equal(a, b) for a, b in videos)
    return out


def solo_check(pipeline: Pipeline, spec: RolloutSpec, trajs: list[Trajectory], private: list[Rollout],
               n: int) -> dict[str, Any]:
    """The first ``n`` requests again through the engine one at a time (``max_batch=1``: the private
    loop's shapes), compared with the private loop's (``solo_*``: every difference): the same math,
    so what the batched run differs by is batch-composition rounding only (``run_one`` judges them:
    latents and frames bit-equal, log-probs within ``SOLO_LOGPROB_TOL``)."""
    requests = [spec.request(t.prompt, seed_of(t)) for t in trajs[:n]]
    records = LibraryClient.of(pipeline, max_batch=1).run(requests)
    solo = [as_rollout(trajectory_of(rec, req, t.prompt, 0)) for rec, req, t in zip(records, requests, trajs)]
    agree = agreement(solo, private[:n])  # every difference, so a failure says where it is
    return {f"solo_{k}": v for k, v in agree.items() if k != "bit_equal"} | {"solo_engine_bit_equal": agree["bit_equal"]}


def run_one(args: argparse.Namespace, pipeline: Pipeline, frames: int, base: dict[str, Any]) -> dict[str, Any]:
    device = pipeline.device
    spec = RolloutSpec(steps=args.steps, height=args.height, width=args.width, num_frames=frames,
                       guidance_scale=args.guidance, decode=not args.no_decode, noise_level=args.noise_level)
    n = args.group_size * args.groups
    latent = PrivateLoop(pipeline, spec).shape  # [1, C, f, h, w]
    pt, ph, pw = base["patch"]
    row = {**base, "load_avg_1m": round(os.getloadavg()[0], 2), "frames": frames, "latent_shape": list(latent),
           "video_tokens": latent[2] // pt * (latent[3] // ph) * (latent[4] // pw), "requests": n,
           "repeats": args.repeats}

    def engine_run() -> list[Trajectory]:
        return engine_rollouts(pipeline, spec, group_size=args.group_size, groups=args.groups,
                               max_batch=args.max_batch, seed=args.seed)

    if args.warmup:  # first calls: allocator, kernels' plans, lazy imports (one request each way)
        engine_rollouts(pipeline, spec, group_size=1, groups=1, max_batch=1, seed=args.seed + 1)
        PrivateLoop(pipeline, spec).rollout(PROMPTS[0], 1)
    sizes: Counter = Counter()
    engine_t: list[Timing] = []
    private_t: list[Timing] = []
    for _ in range(args.repeats):  # alternating, so a load change on a shared box hits both paths
        with counted_batches(sizes):
            trajs, timing = timed_peak(device, engine_run)
        engine_t.append(timing)
        requests = [(t.prompt, seed_of(t)) for t in trajs]  # the very same prompts and seeds

        def private_run() -> list[Rollout]:
            loop = PrivateLoop(pipeline, spec)  # a fresh text cache: each prompt encoded once, in the timing
            return [loop.rollout(prompt, seed) for prompt, seed in requests]

        private, timing = timed_peak(device, private_run)
        private_t.append(timing)
    engine = [as_rollout(t) for t in trajs]
    cuda = device.type == "cuda"
    e, p = summary(engine_t, n, cuda), summary(private_t, n, cuda)
    emit({**row, "path": "engine", **e, "max_batch": args.max_batch,
          "denoise_step_calls_by_batch": {str(k): v // args.repeats for k, v in sorted(sizes.items())},
          "mean_batch": round(sum(k * v for k, v in sizes.items()) / max(sum(sizes.values()), 1), 2)}, args.sink)
    emit({**row, "path": "private", **p, "batch": 1}, args.sink)
    agree = agreement(engine, private)
    tol = LATENT_TOL[args.dtype]
    agree.update(latent_rel_tol=tol, log_prob_tol=LOGPROB_TOL,
                 ok=agree["latents_rel_diff"] <= tol and agree["log_probs_max_abs_diff"] <= LOGPROB_TOL)
    if args.solo_check:
        agree.update(solo_check(pipeline, spec, trajs, private, min(2, n)))
        solo_ok = agree["solo_latents_max_abs_diff"] == 0.0 and agree.get("solo_video_equal", True) \
            and agree["solo_log_probs_max_abs_diff"] <= SOLO_LOGPROB_TOL
        agree["ok"] = agree["ok"] and solo_ok
    emit({**row, "metric": "agreement", **agree}, args.sink)
    emit({**row, "metric": "ratio", "engine_over_private": round(p["seconds"] / e["seconds"], 3),
          "engine_over_private_cpu": round(p["cpu_seconds"] / e["cpu_seconds"], 3),
          "engine_rollouts_per_s": e["rollouts_per_s"], "private_rollouts_per_s": p["rollouts_per_s"]}, args.sink)
    emit({**row, **forward_scaling(pipeline, spec, args.max_batch)}, args.sink)
    if args.profile:
        for name, fn in (("engine", engine_run), ("private", private_run)):
            for r in profile_top(fn, cuda=cuda, steps=1, top=args.profile):
                emit({**row, "metric": f"profile[{name}]", **r}, args.sink)
    return agree


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="the 2-block toy, 32x32x5, 2 steps, 2 groups of 2 (smoke test)")
    p.add_argument("--model", help="a diffusers Wan folder instead of a random one")
    p.add_argument("--size", choices=SIZES, default=None, help="wan_random size (cpu: small, cuda: full)")
    p.add_argument("--dtype", default=None, help="cpu: float32, cuda: bfloat16")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", default=None, help="frame counts, comma separated: one measurement each")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None, help="N same-prompt requests a group (8; 16 also)")
    p.add_argument("--groups", type=int, default=None, help="G groups, one prompt each (2)")
    p.add_argument("--max-batch", type=int, default=None, help="the engine's requests per step (default N)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the checkpoint's, 5)")
    p.add_argument("--noise-level", type=float, default=None, help="flow_sde's (default 0.7)")
    p.add_argument("--no-decode", action="store_true", help="latents only (NFT-class / latent rewards)")
    # 1: on the shared 2-core box two threads spun against the other processes (~30x slower per op)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each path, alternating (cpu 3, cuda 1)")
    p.add_argument("--no-solo-check", dest="solo_check", action="store_false",
                   help="skip re-running 2 requests through the engine alone (checked bit-equal to the private loop)")
    p.add_argument("--profile", type=int, default=0, help="print the top K ops/kernels of each path")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    fill_unset(args, PRESETS["tiny" if args.tiny else ("cuda" if args.device.startswith("cuda") else "cpu")])
    fill_unset(args, {"group_size": 8, "groups": 2})
    fill_unset(args, {"max_batch": args.group_size})
    if args.groups > len(PROMPTS):
        raise ValueError(f"--groups {args.groups}: at most {len(PROMPTS)} (one prompt each)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # the random checkpoint is built on the device (no fp32 host copy of 1.3B parameters to make)
    folder = Path(args.model) if args.model else save_random_wan(size=args.size, device=device.type)
    pipeline = load_pipeline(folder, LoadOptions(device=device, dtype=getattr(torch, args.dtype)))[1]
    if args.guidance is None:
        args.guidance = pipeline.defaults.guidance_scale
    stage = pipeline.spec.node("denoise").stage
    assert isinstance(stage, DenoiseLoop)
    dit = pipeline.components["transformer"]
    te = pipeline.components["text_encoder"]
    cfg, te_cfg = dit.config, te.model.config
    base = {"bench": "rl_rollout", "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "threads": args.threads if device.type == "cpu" else None, "model": args.model or f"wan_random:{args.size}",
            "dit_params": sum(p.numel() for p in dit.parameters()), "dit_layers": len(dit.blocks),
            "dit_width": cfg.num_attention_heads * cfg.attention_head_dim, "patch": list(cfg.patch_size),
            "text_encoder": f"{type(te.model).__name__}: {te_cfg.num_layers} layer(s), d_model {te_cfg.d_model}",
            "text_encoder_params": sum(p.numel() for p in te.model.parameters()), "dtype": args.dtype,
            "height": args.height, "width": args.width, "steps": args.steps, "group_size": args.group_size,
            "groups": args.groups, "guidance": args.guidance, "cfg_mode": stage.cfg.mode,
            "decode": not args.no_decode, "sampler": "flow_sde", "log_probs": True, "trajectory": True}
    failed = []
    with jsonl_sink(args.out) as sink:
        args.sink = sink
        for frames in (int(f) for f in str(args.frames).split(",")):
            agree = run_one(args, pipeline, frames, base)
            if not agree["ok"]:
                failed.append((frames, agree))
    if failed:
        raise SystemExit(f"engine and private rollouts disagree beyond the tolerance: {failed}")


if __name__ == "__main__":
    main()
