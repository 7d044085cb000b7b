"""Engine benchmarks, side by side in one run (JSON lines):

  overhead  engine-driven DenoiseLoop vs a plain hand-written loop over the same model
  mixed     4-step and 50-step (--long-steps; --tiny: 12) requests, all at t0 and as Poisson arrivals: the step
            scheduler (SRPT, steps batched across requests) vs two request-level baselines
            on the same trace: FIFO at batch 1, and FIFO with request-level batching of
            same-shape requests (sglang-style dynamic batching: requests of one shape that
            wait together run as one batch start to finish); latency per class, makespan,
            and every ratio (baseline / step scheduler for latencies, step scheduler /
            baseline for throughput: > 1 means the step scheduler is better)
  small     many single-frame requests: batched steps vs one request per step

    python benchmarks/bench_engine.py              # GPU: Wan2.1-1.3B architecture
    python benchmarks/bench_engine.py --tiny       # CPU: toy sizes (ratios only)

Poisson arrivals: a seeded exponential inter-arrival trace at ``--load`` times the rate the
FIFO baseline serves (measured on the all-at-t0 trace), the same trace for every policy;
a request's latency is its finish minus its arrival.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import dims, emit, fill_unset, jsonl_sink  # noqa: E402
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart  # noqa: E402




def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def request(rid, steps, size, frames, seed=0, guidance=5.0, task=TaskType.T2V):
    return OmniRequest(task=task, request_id=rid, inputs=[TextPart(text=f"a red circle {rid}")],
                       diffusion=DiffusionParams(steps=steps, height=size, width=size, num_frames=frames, seed=seed,
                                                 guidance_scale=guidance))


def engine_for(pipeline, **policy) -> Engine:
    return Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(**policy)))


def bench_overhead(pipeline, args, base, sink):
    """Per-step time: plain loop (model forward + sampler step, nothing else) vs engine."""
    device, steps = pipeline.device, args.overhead_steps
    size, frames = args.overhead_size
    engine = engine_for(pipeline, max_batch=1)
    engine.add_request(request("warm", 2, size, frames, guidance=1.0))
    engine.run_until_done("warm")
    engine.add_request(request("eng", steps, size, frames, guidance=1.0))
    step_times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        plan_before = engine.stats.steps
        engine.step()
        sync(device)
        if engine.stats.steps > plan_before:
            step_times.append(time.perf_counter() - t0)
    engine_step = statistics.median(step_times)

    # the same loop, hand-written
    model, sampler = pipeline.components["transformer"], pipeline.components["sampler"].get(None)
    text = torch.randn(1, 512, model.config.text_dim, device=device, dtype=pipeline.dtype)
    shapes = (1, 16, (frames - 1) // 4 + 1, size // 8, size // 8)
    x = torch.randn(shapes, generator=torch.Generator("cpu").manual_seed(0)).to(device)
    state = sampler.init_state(steps, device=device)
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pred = model(x.to(pipeline.dtype), state.timestep.expand(1), text)
        x = sampler.step(state, pred.float(), x).float()
        sync(device)
        plain.append(time.perf_counter() - t0)
    plain_step = statistics.median(plain)
    emit({**base, "bench": "engine_overhead", "shape": [size, size, frames], "steps": steps,
          "plain_step_s": plain_step, "engine_step_s": engine_step,
          "overhead_pct": round(100 * (engine_step / plain_step - 1), 2)}, sink)


def run_trace(pipeline, trace, arrivals=None, **policy):
    """Submit ``trace[i]`` at ``arrivals[i]`` seconds (default: all at t0), stepping the engine
    meanwhile (a request that arrives during a step joins at its end, as in a server).
    -> ({request id: latency = finish - arrival}, makespan, engine)."""
    engine = engine_for(pipeline, **policy)
    arrivals = arrivals or [0.0] * len(trace)
    arrive, done, i = {}, {}, 0
    t0 = time.perf_counter()
    while i < len(trace) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(trace) and arrivals[i] <= now:
            engine.add_request(trace[i])
            arrive[trace[i].request_id] = arrivals[i]
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now))  # idle until the next arrival
            continue
        for out in engine.step():
            done[out.request_id] = time.perf_counter() - t0 - arrive[out.request_id]
    return done, time.perf_counter() - t0, engine


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def poisson_arrivals(n, rate, seed=0):
    """Arrival times of ``n`` requests at ``rate`` per second (exponential gaps, seeded)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


MIXED_POLICIES = {
    "fifo": lambda n, b: dict(kind="fifo", max_running=1, max_batch=1),
    "fifo_batch": lambda n, b: dict(kind="fifo_batch", max_running=b, max_batch=b),
    "step_scheduler": lambda n, b: dict(kind="srpt", max_running=n, max_batch=b),
}
LATENCIES = ("p50_short_s", "p95_short_s", "p95_long_s", "mean_s")


def _mixed_figures(pipeline, trace, arrivals, policy, repeats):
    runs = []
    for _ in range(repeats):  # the median run's figures: a CPU trace lasts ~0.3 s, one pause skews it
        done, makespan, _ = run_trace(pipeline, trace, arrivals, **policy)
        short = [t for r, t in done.items() if r.startswith("short")]
        long = [t for r, t in done.items() if r.startswith("long")]
        runs.append({"p50_short_s": pct(short, 0.5), "p95_short_s": pct(short, 0.95), "p95_long_s": pct(long, 0.95),
                     "mean_s": statistics.fmean(done.values()), "makespan_s": makespan,
                     "throughput_req_s": len(trace) / makespan})
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def bench_mixed(pipeline, args, base, sink):
    size, frames = args.mixed_size
    trace = []
    for i in range(max(args.n_long, args.n_short)):
        if i < args.n_long:
            trace.append(request(f"long{i}", args.long_steps, size, frames, seed=i))
        for j in range(args.n_short // args.n_long if args.n_long else args.n_short):
            k = i * max(1, args.n_short // max(1, args.n_long)) + j
            if k < args.n_short:
                trace.append(request(f"short{k}", 4, size, frames, seed=100 + k))
    run_trace(pipeline, trace[:2])  # warm up
    shape = {"shape": [size, size, frames], "n_long": args.n_long, "long_steps": args.long_steps, "n_short": args.n_short,
             "short_steps": 4, "repeats": args.trace_repeats}
    results: dict[str, dict[str, dict]] = {}
    arrivals = {"t0": None}
    for pattern in ("t0", "poisson"):
        if pattern == "poisson":  # offered load relative to what FIFO serves
            rate = args.load * len(trace) / results["t0"]["fifo"]["makespan_s"]
            arrivals["poisson"] = poisson_arrivals(len(trace), rate)
        results[pattern] = {}
        for name, make in MIXED_POLICIES.items():
            policy = make(len(trace), args.max_batch)
            figures = _mixed_figures(pipeline, trace, arrivals[pattern], policy, args.trace_repeats)
            results[pattern][name] = figures
            extra = {"load": args.load, "rate_req_s": round(rate, 4)} if pattern == "poisson" else {}
            emit({**base, "bench": "mixed_trace", "arrivals": pattern, "policy": name, "max_batch": policy["max_batch"],
                  **shape, **extra, **figures}, sink)
        ours = results[pattern]["step_scheduler"]
        for baseline in ("fifo", "fifo_batch"):
            theirs = results[pattern][baseline]
            for metric in LATENCIES:
                emit({**base, "bench": "mixed_trace", "arrivals": pattern, "metric": metric, "baseline": baseline,
                      "ratio": round(theirs[metric] / ours[metric], 3)}, sink)
            emit({**base, "bench": "mixed_trace", "arrivals": pattern, "metric": "throughput_req_s", "baseline": baseline,
                  "ratio": round(ours["throughput_req_s"] / theirs["throughput_req_s"], 3)}, sink)


def bench_small(pipeline, args, base, sink):
    size = args.small_size
    trace = [request(f"img{i}", args.small_steps, size, 1, seed=i, task=TaskType.T2I) for i in range(args.n_small)]
    run_trace(pipeline, trace[:2], max_batch=2)
    rates = {}
    for name, batch in (("sequential", 1), ("batched", args.max_batch)):
        _, makespan, engine = run_trace(pipeline, trace, kind="srpt", max_running=len(trace), max_batch=batch)
        rates[name] = len(trace) / makespan
        emit({**base, "bench": "small_requests", "mode": name, "max_batch": batch, "n": len(trace), "size": size,
              "steps": args.small_steps, "makespan_s": makespan, "throughput_req_s": rates[name],
              "batched_steps": engine.stats.batched_steps}, sink)
    emit({**base, "bench": "small_requests", "metric": "batched_over_sequential_throughput",
          "value": round(rates["batched"] / rates["sequential"], 2)}, sink)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random one is built)")
    p.add_argument("--only", default="overhead,mixed,small")
    p.add_argument("--out", default=None)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--load", type=float, default=0.85, help="Poisson offered load, as a share of FIFO's rate")
    p.add_argument("--overhead-size", type=dims, default=None, help="SIZExFRAMES of the overhead run (GPU 480x81; tiny 32x9)")
    p.add_argument("--overhead-steps", type=int, default=None)
    p.add_argument("--long-steps", type=int, default=None, help="steps of the mixed trace's long requests (50; --tiny 12)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        torch.set_num_threads(1)  # toy sizes: threads only add scheduling noise
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # overhead at 480x480: 21*30*30 = 18,900 tokens
        fill_unset(args, dict(overhead_size=(480, 81), overhead_steps=6, long_steps=50,
                              mixed_size=(256, 17), n_long=2, n_short=6, trace_repeats=1,
                              small_size=256, small_steps=8, n_small=32))
    else:  # long_steps: 3x a short request, still the long class
        fill_unset(args, dict(overhead_size=(32, 9), overhead_steps=8, long_steps=12,
                              mixed_size=(32, 5), n_long=2, n_short=4, trace_repeats=3,
                              small_size=32, small_steps=4, n_small=8))
    from wan_random import save_random_wan

    folder = args.model or save_random_wan(size="full" if cuda else "tiny", device=str(device))
    opts = LoadOptions(device=device, dtype=dtype, attention_backend="sdpa")
    _, pipeline = load_pipeline(folder, opts)
    base = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).removeprefix("torch."),
            "model": "wan2.1-1.3b-arch" if cuda else ("wan-tiny" if args.model is None else Path(args.model).name)}
    with jsonl_sink(args.out) as sink:
        with torch.inference_mode():
            only = set(args.only.split(","))
            if "overhead" in only:
                bench_overhead(pipeline, args, base, sink)
            if "mixed" in only:
                bench_mixed(pipeline, args, base, sink)
            if "small" in only:
                bench_small(pipeline, args, base, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
