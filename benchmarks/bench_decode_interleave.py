"""A small request's latency while a large video decodes, with the decode as one node (before)
and as the decode loop's steps (after), on the same weights in one run (CPU: ratios).

    python benchmarks/bench_decode_interleave.py                      # shapes-t2v-4step
    python benchmarks/bench_decode_interleave.py --large 256x256x33 --small 64x64x5
    python benchmarks/bench_decode_interleave.py --random-wan full --device cuda --dtype bfloat16 \
        --large 480x832x81 --small 256x256x5 --steps 4 --out x.jsonl      # GPU: Wan2.1-1.3B architecture

The engine is in-process and synchronous: the large request runs until its next node is the
decode (the loop: until its first decode step ran), then the small one arrives; the small one's latency is wall time from its arrival to
its output. One JSON line per mode (and the solo latency), appended to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from common import emit


def request(size: str, rid: str, steps: int | None = None):
    from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

    h, w, f = (int(x) for x in size.split("x"))
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle moving right")], request_id=rid,
                       diffusion=DiffusionParams(seed=1, height=h, width=w, num_frames=f, steps=steps))


def with_one_shot_decode(pipeline):
    """The pipeline with today's one-shot ``VAEDecode`` node in place of the decode loop."""
    from omniloop.pipeline.stages.decode import VAEDecode

    node = pipeline.spec.node("decode")
    stage = VAEDecode(component=node.stage.component, whole=node.stage.whole)
    spec = dataclasses.replace(pipeline.spec, nodes=tuple(dataclasses.replace(n, stage=stage) if n is node else n
                                                          for n in pipeline.spec.nodes))
    return dataclasses.replace(pipeline, spec=spec)


def run_to_end(engine, rid: str) -> float:
    t0 = time.perf_counter()
    engine.run_until_done(rid)
    _sync()
    return time.perf_counter() - t0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def concurrent(engine, large: str, small: str, n: int, steps: int | None) -> dict:
    """The large request up to its decode, then the small one; latencies of both."""
    lid = engine.add_request(request(large, f"large{n}", steps))
    t_large = time.perf_counter()
    with torch.inference_mode():
        while engine._requests[lid].node is None or engine._requests[lid].node.name != "decode":
            engine.step()
        if engine._requests[lid].node.is_loop:  # the decode loop: its init and first step, so it is under way
            engine.step(), engine.step()
        if not engine.has_unfinished():
            raise SystemExit(f"--large {large} decoded in two steps: pass a larger --large")
        _sync()
        sid = engine.add_request(request(small, f"small{n}", steps))
        t_small, done = time.perf_counter(), {}
        while engine.has_unfinished():
            outs = engine.step()
            if outs:
                _sync()
            for out in outs:
                done[out.request_id] = time.perf_counter()
    return {"small_s": round(done[sid] - t_small, 3), "large_s": round(done[lid] - t_large, 3)}


def main(argv: list[str] | None = None) -> int:
    from omniloop.engine import Engine, EngineConfig
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="shapes-t2v-4step")
    p.add_argument("--large", default="256x256x33")
    p.add_argument("--small", default="64x64x5")
    p.add_argument("--random-wan", choices=("full", "small", "tiny"), default=None,
                   help="build a random Wan checkpoint of this size (wan_random.py) instead of --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=None, help="denoise steps of both requests (default the model's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_interleave_cpu.jsonl"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, scratch = args.model, None
    if args.random_wan:
        from wan_random import save_random_wan

        scratch = save_random_wan(size=args.random_wan)
        model = str(scratch)
    options = LoadOptions(device=torch.device(args.device), dtype=getattr(torch, args.dtype))
    pipeline = load_pipeline(model, options)[1]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with open(args.out, "a") as sink:
        for mode, pipe in (("one_shot", with_one_shot_decode(pipeline)), ("loop", pipeline)):
            engine = Engine(pipe, EngineConfig())
            run_to_end(engine, engine.add_request(request(args.small, "warm", args.steps)))  # one-time set-up
            if args.device != "cpu":  # the large shape's kernels too (cuDNN autotune, compile), outside the timing
                run_to_end(engine, engine.add_request(request(args.large, "warm_large", args.steps)))
            solo = min(run_to_end(engine, engine.add_request(request(args.small, f"solo{i}", args.steps)))
                       for i in range(2))
            record = {"bench": "decode_interleave", "model": args.random_wan and f"random-wan-{args.random_wan}"
                      or args.model, "mode": mode, "large": args.large, "small": args.small, "steps": args.steps,
                      "device": device, "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "small_solo_s": round(solo, 3), **concurrent(engine, args.large, args.small, 0, args.steps)}
            record["small_ratio"] = round(record["small_s"] / solo, 2)
            emit(record, sink)
    if scratch is not None:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
