"""A small request's latency while a large video decodes, with the decode as one node (before)
and as the decode loop's steps (after), on the same weights in one run (CPU: ratios).

    python benchmarks/bench_decode_interleave.py                      # shapes-t2v-4step
    python benchmarks/bench_decode_interleave.py --large 256x256x33 --small 64x64x5

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
    return time.perf_counter() - t0


def concurrent(engine, large: str, small: str, n: int) -> dict:
    """The large request up to its decode, then the small one; latencies of both."""
    lid = engine.add_request(request(large, f"large{n}"))
    t_large = time.perf_counter()
    with torch.inference_mode():
        while engine._requests[lid].node is None or engine._requests[lid].node.name != "decode":
            engine.step()
        if engine._requests[lid].node.is_loop:  # the decode loop: its init and first step, so it is under way
            engine.step(), engine.step()
        sid = engine.add_request(request(small, f"small{n}"))
        t_small, done = time.perf_counter(), {}
        while engine.has_unfinished():
            for out in engine.step():
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
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_interleave_cpu.jsonl"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipeline = load_pipeline(args.model, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    with open(args.out, "a") as sink:
        for mode, pipe in (("one_shot", with_one_shot_decode(pipeline)), ("loop", pipeline)):
            engine = Engine(pipe, EngineConfig())
            run_to_end(engine, engine.add_request(request(args.small, "warm")))  # one-time kernel set-up
            solo = min(run_to_end(engine, engine.add_request(request(args.small, f"solo{i}"))) for i in range(2))
            record = {"bench": "decode_interleave", "model": args.model, "mode": mode, "large": args.large,
                      "small": args.small, "threads": torch.get_num_threads(), "small_solo_s": round(solo, 3),
                      **concurrent(engine, args.large, args.small, 0)}
            record["small_ratio"] = round(record["small_s"] / solo, 2)
            emit(record, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
