"""Parallelism figures, 1 rank vs N ranks, side by side in one run (JSON lines):

  step   one denoise step (cond + uncond forwards) of the Wan DiT: one GPU, then each axis
         (ulysses, ring, cfg, tp) over N ranks, random weights; scaling efficiency
         = one-GPU time / (N x N-rank time); rel. L2 of the N-rank output vs the one-GPU one
  e2e    text -> video through VideoGenerator: one process vs SPMD pools (parallel=...)
  mixed  the engine benchmark's mixed trace (4-step and 50-step requests arriving together)
         on one rank vs on a pool

    python benchmarks/bench_parallel.py --tiny                             # CPU: 2 gloo ranks, toy sizes
    python benchmarks/bench_parallel.py --only step --arch 1.3b            # 2 GPUs: 720p x 81 frames
    python benchmarks/bench_parallel.py --only step --arch 14b --iters 1
    python benchmarks/bench_parallel.py --only e2e,mixed --arch 1.3b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import built_in, emit, fill_unset, jsonl_sink  # noqa: E402
from omniloop.models.families.wan.presets import WAN21_T2V_1_3B, WAN21_T2V_14B  # noqa: E402

AXES = ("ulysses", "ring", "cfg", "tp")
TINY_ARCH = {**WAN21_T2V_1_3B, "num_attention_heads": 4, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2,
             "text_dim": 32, "freq_dim": 16}
ARCHS = {"1.3b": WAN21_T2V_1_3B, "14b": WAN21_T2V_14B, "tiny": TINY_ARCH}


# -- step: the DiT alone, on N ranks -------------------------------------------------------


def _build_dit(arch: dict, device: torch.device, dtype: torch.dtype):
    """Random weights, seeded: every rank builds the same model (fp32 where loading keeps fp32)."""
    from omniloop.models.families.wan.model import WanDiT, WanDiTConfig, keeps_fp32

    torch.manual_seed(0)
    model = built_in(device, dtype, lambda: WanDiT(WanDiTConfig(**arch)))
    for name, p in model.named_parameters():
        if keeps_fp32(name):
            p.data = p.data.float()
    return model


def _inputs(arch: dict, latent: tuple[int, int, int], text_len: int, device, dtype):
    g = torch.Generator("cpu").manual_seed(1)
    x = torch.randn(1, arch["in_channels"], *latent, generator=g).to(device, dtype)
    cond = torch.randn(1, text_len, arch["text_dim"], generator=g).to(device, dtype)
    uncond = torch.randn(1, text_len, arch["text_dim"], generator=g).to(device, dtype)
    return x, torch.tensor([500.0], device=device), cond, uncond


def _timed(fn, warmup: int, iters: int, device, *, all_ranks: bool) -> list[float]:
    """Seconds of each call after ``warmup``; ``all_ranks``: every rank times it together
    (a barrier before each call, so one rank's lead does not count as speed)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if all_ranks:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def step_rank(rank: int, world: int, arch: dict, latent, text_len: int, axes, warmup: int, iters: int) -> dict:
    """On every rank: rank 0 first times the one-device step alone, then every axis on all ranks."""
    import torch.distributed as dist

    from omniloop.models.families.wan.parallelize import WAN_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.rows import RowPlacement
    from omniloop.parallel.spec import ParallelSpec

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, t, cond, uncond = _inputs(arch, latent, text_len, device, dtype)
    out: dict = {}
    with torch.inference_mode():
        if rank == 0:
            model = _build_dit(arch, device, dtype)
            reference = model(x, t, cond).float()
            out["one"] = _timed(lambda: (model(x, t, cond), model(x, t, uncond)), warmup, iters, device, all_ranks=False)
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        for axis in axes:
            mesh = ParallelMesh.build(ParallelSpec(**{axis: world}), device)
            model = _build_dit(arch, device, dtype)
            if axis == "cfg":
                rows = RowPlacement.for_mesh(mesh)
                calls, branches = [(0, "cond"), (0, "uncond")], ("cond", "uncond")
                text = {"cond": cond, "uncond": uncond}
                (mine,) = rows.local_calls(calls, branches)

                def step():
                    preds = [{mine[1]: {"video": model(x, t, text[mine[1]]).float()}}]
                    rows.exchange(preds, calls, branches, like=[{"video": x}])
                    return preds[0]["cond"]["video"]
            else:
                parallelize_model(model, WAN_PARALLEL, mesh)

                def step():
                    y = model(x, t, cond)
                    model(x, t, uncond)
                    return y
            first = step()
            if rank == 0:
                out[f"rel_l2[{axis}]"] = ((first.float() - reference).norm() / reference.norm()).item()
            out[axis] = _timed(step, warmup, iters, device, all_ranks=True)
            model = None  # free it before the next axis builds its own
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def bench_step(args, base, sink) -> None:
    from omniloop.parallel.launch import run_on_ranks

    arch = {**ARCHS[args.arch], **({"num_layers": args.layers} if args.layers else {})}
    f, h, w = args.latent
    tokens = f * (h // 2) * (w // 2)
    results = run_on_ranks(step_rank, args.world, arch, args.latent, args.text_len, args.axes, args.warmup, args.iters,
                           device=args.device, timeout_s=3600)
    one = statistics.median(results[0]["one"])
    shape = {"arch": args.arch, "layers": arch["num_layers"], "latent": list(args.latent), "tokens": tokens,
             "video": args.video}
    emit({**base, **shape, "bench": "step", "ranks": 1, "axis": "none", "step_s": one}, sink)
    for axis in args.axes:
        step = max(statistics.median(r[axis]) for r in results)  # the slowest rank sets the step
        emit({**base, **shape, "bench": "step", "ranks": args.world, "axis": axis, "step_s": step,
              "speedup": round(one / step, 3), "efficiency": round(one / step / args.world, 3),
              "rel_l2_vs_one": results[0][f"rel_l2[{axis}]"]}, sink)


# -- e2e and mixed: through the engine -------------------------------------------------------


def _request(rid, steps, size, frames, seed=0, guidance=5.0):
    from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

    height, width = size
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text=f"a red circle {rid}")],
                       diffusion=DiffusionParams(steps=steps, height=height, width=width, num_frames=frames, seed=seed,
                                                 guidance_scale=guidance))


def _generator(folder, spec: str | None, device: str):
    from omniloop.api.generator import VideoGenerator

    t0 = time.perf_counter()
    gen = VideoGenerator.from_pretrained(folder, device=device, **({"parallel": spec} if spec else {}))
    return gen, time.perf_counter() - t0


def bench_e2e(args, folder, base, sink) -> None:
    size, frames = args.e2e_size, args.e2e_frames
    one = None
    for spec in [None, *args.e2e_specs]:
        gen, load_s = _generator(folder, spec, args.device)
        try:
            with torch.inference_mode():
                gen.generate(_request("warm", 1, size, frames))  # kernels, allocator, text encoder
                t0 = time.perf_counter()
                out = gen.generate(_request("e2e", args.e2e_steps, size, frames))
                seconds = time.perf_counter() - t0
        finally:
            gen.close()
        assert out.status.value == "completed", out.error
        one = seconds if spec is None else one
        record = {**base, "bench": "e2e", "parallel": spec or "one", "ranks": 1 if spec is None else args.world,
                  "shape": [*size, frames], "steps": args.e2e_steps, "seconds": seconds, "load_s": load_s,
                  "node_s": {k: round(v, 3) for k, v in out.metrics.node_s.items()}}
        if spec is not None:
            record["speedup"] = round(one / seconds, 3)
        emit(record, sink)


def _trace(args):
    size, frames = args.mixed_size, args.mixed_frames
    trace = []
    for i in range(args.n_long):
        trace.append(_request(f"long{i}", 50, size, frames, seed=i))
        for j in range(args.n_short // max(1, args.n_long)):
            trace.append(_request(f"short{i}_{j}", 4, size, frames, seed=100 + j))
    return trace


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_mixed(args, folder, base, sink) -> None:
    trace = _trace(args)
    for spec in [None, args.mixed_spec]:
        gen, _ = _generator(folder, spec, args.device)
        engine = gen.engine
        engine.scheduler.policy = type(engine.scheduler.policy)(kind="srpt", max_running=len(trace),
                                                                 max_batch=args.max_batch)
        try:
            with torch.inference_mode():
                engine.add_request(_request("warm", 2, args.mixed_size, args.mixed_frames))
                engine.run_until_done("warm")
                engine.pop_output("warm")
                t0 = time.perf_counter()
                for r in trace:
                    engine.add_request(r)
                done = {}
                while engine.has_unfinished():
                    for out in engine.step():
                        done[out.request_id] = time.perf_counter() - t0
                makespan = time.perf_counter() - t0
        finally:
            gen.close()
        short = [v for k, v in done.items() if k.startswith("short")]
        long = [v for k, v in done.items() if k.startswith("long")]
        emit({**base, "bench": "mixed_trace", "parallel": spec or "one", "ranks": 1 if spec is None else args.world,
              "shape": [*args.mixed_size, args.mixed_frames], "n_long": args.n_long, "n_short": len(short),
              "p50_short_s": _pct(short, 0.5), "p95_short_s": _pct(short, 0.95), "p95_long_s": _pct(long, 0.95),
              "makespan_s": makespan, "throughput_req_s": len(trace) / makespan}, sink)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke: 2 gloo ranks, toy sizes")
    p.add_argument("--only", default="step,e2e,mixed")
    p.add_argument("--arch", default=None, choices=sorted(ARCHS), help="DiT of the step bench (default 1.3b; tiny with --tiny)")
    p.add_argument("--layers", type=int, default=None, help="step bench: keep only this many blocks (time scales with them)")
    p.add_argument("--axes", default=",".join(AXES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint dir for e2e/mixed (default: a random one is built)")
    p.add_argument("--e2e-steps", type=int, default=4)
    p.add_argument("--e2e-specs", default="cfg=2;ulysses=2,vae=tiles", help="';'-separated pool specs")
    p.add_argument("--mixed-spec", default="cfg=2")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    args.device = "cuda" if cuda else "cpu"
    fill_unset(args, {"arch": "1.3b" if cuda else "tiny"})
    args.axes = tuple(a for a in args.axes.split(",") if a)
    args.e2e_specs = [s for s in args.e2e_specs.split(";") if s]
    if cuda:
        args.video = [720, 1280, 81]  # 720p, 81 frames: latent 21 x 90 x 160 -> 75,600 tokens
        args.latent, args.text_len = (21, 90, 160), 512
        args.e2e_size, args.e2e_frames = (720, 1280), 81
        args.mixed_size, args.mixed_frames, args.n_long, args.n_short = (256, 256), 17, 4, 8
        if torch.cuda.device_count() < args.world:
            raise SystemExit(f"needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    else:
        torch.set_num_threads(1)  # toy sizes: one thread per rank and for the one-process baseline alike
        args.video = [64, 64, 9]
        args.latent, args.text_len = (3, 8, 8), 16
        args.e2e_size, args.e2e_frames, args.e2e_steps = (32, 32), 5, 2
        args.e2e_specs = [s.replace("vae=tiles", "vae=tiles,vae_tile=16,vae_stride=8") for s in args.e2e_specs]
        args.mixed_size, args.mixed_frames, args.n_long, args.n_short = (32, 32), 5, 1, 2
    base = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16" if cuda else "float32",
            "world": args.world, "torch": torch.__version__}
    only = set(args.only.split(","))
    with jsonl_sink(args.out) as sink:
        if "step" in only:
            bench_step(args, base, sink)
        if only & {"e2e", "mixed"}:
            from wan_random import save_random_wan

            folder = args.model or save_random_wan(size="full" if cuda else "tiny", device=args.device)
            model = "wan2.1-1.3b-arch" if cuda else "wan-tiny"
            if "e2e" in only:
                bench_e2e(args, folder, {**base, "model": model}, sink)
            if "mixed" in only:
                bench_mixed(args, folder, {**base, "model": model}, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
