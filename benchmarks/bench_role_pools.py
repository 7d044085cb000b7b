"""Role pools vs one pool (issue 32 item 6, video half): a random-weight Wan T2V with its text
encoding, denoising and decoding on three role pools (three worker processes on one device,
shared-memory connectors) against the same requests on one process. Prints JSON lines: the
end-to-end seconds of both, whether the outputs are equal, and the connector transfers per
direction (count, bytes, seconds).

    python3 benchmarks/bench_role_pools.py --size tiny --device cpu            # seconds, on CPU
    python3 benchmarks/bench_role_pools.py --size full --device cuda --height 480 --width 832 \\
        --frames 81 --steps 4 --out $OUT/role_pools_h200.jsonl                 # on one GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.* when run as a script

from benchmarks.common import emit  # noqa: E402
from benchmarks.wan_random import SIZES, save_random_wan  # noqa: E402


def _requests(n: int, args: argparse.Namespace, tag: str) -> list:
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    return [OmniRequest(request_id=f"{tag}{i}", task=TaskType.T2V, inputs=[TextPart(text="a red circle moving right")],
                        outputs=OutputSpec(return_latents=True),
                        diffusion=DiffusionParams(seed=i, steps=args.steps, height=args.height, width=args.width,
                                                  num_frames=args.frames))
            for i in range(n)]


def _run(engine, requests) -> tuple[float, dict]:
    for r in requests:
        engine.add_request(r)
    t0 = time.perf_counter()
    outs = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for rid in outs:
        engine.pop_output(rid)
    return seconds, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sink = args.out.open("a") if args.out else None

    from omniloop.deploy import DeployConfig
    from omniloop.engine import Engine, EngineConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.engine.role_pool import launch_role_engine
    from omniloop.models.loader import load_pipeline

    model = save_random_wan(size=args.size)
    pools = {"encode": {"device": args.device}, "denoise": {"device": args.device}, "decode": {"device": args.device}}
    deploy = DeployConfig(device=args.device, pools=pools,
                          placement={"text_encode": "encode", "denoise": "denoise", "decode": "decode"})
    pipeline = load_pipeline(model, load_options(deploy))[1]
    base = {"bench": "role_pools", "size": args.size, "device": args.device, "requests": args.requests,
            "steps": args.steps, "shape": [args.frames, args.height, args.width],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}

    one = Engine(pipeline, EngineConfig.from_deploy(deploy))
    _run(one, _requests(1, args, "warm"))
    one_s, one_outs = _run(one, _requests(args.requests, args, "r"))

    t0 = time.perf_counter()
    split = launch_role_engine(model, deploy, pipeline=pipeline)
    start_s = time.perf_counter() - t0
    try:
        _run(split, _requests(1, args, "warm"))
        for pool in split.pools.values():
            pool.transfers.clear()  # the warm-up's
        split_s, split_outs = _run(split, _requests(args.requests, args, "r"))
        transfers = split.transfers()
    finally:
        split.close()
    equal = all(torch.equal(split_outs[rid].artifacts["latents"].latents, one_outs[rid].artifacts["latents"].latents)
                for rid in one_outs)
    emit({**base, "kind": "end_to_end", "one_pool_s": round(one_s, 4), "three_pools_s": round(split_s, 4),
          "ratio": round(split_s / one_s, 3), "pool_start_s": round(start_s, 2), "outputs_equal": equal}, sink)
    by: dict[tuple, list] = defaultdict(list)
    for t in transfers:
        by[(t.source, t.target, t.edges)].append(t)
    for (source, target, edges), ts in sorted(by.items()):
        emit({**base, "kind": "transfer", "source": source, "target": target, "edges": list(edges), "count": len(ts),
              "bytes_mean": sum(t.bytes for t in ts) // len(ts),
              "seconds_mean": round(sum(t.seconds for t in ts) / len(ts), 6),
              "seconds_total": round(sum(t.seconds for t in ts), 6)}, sink)


if __name__ == "__main__":
    main()
