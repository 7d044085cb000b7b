"""What crash checkpoints cost and save (issue 29 item 8), on one random-weight Wan checkpoint
in one run: a job's denoise loop without checkpoints and with one every ``--every`` steps
written to disk by the server's store (serve/job_checkpoints.py: encode, SHA-256, atomic
write), the checkpoint's size, one save's and one resume's seconds (a new engine: the text
encode again, the loop's init, the restore), and a resumed run's latents vs the uninterrupted
run's (``torch.equal``).

    python benchmarks/bench_resume.py --tiny                                  # CPU: seconds
    python benchmarks/bench_resume.py --size full --shape 480x832x81 --steps 50 --every 10 --device cuda

One JSON line per measurement, appended to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import emit


class TimedStore:
    """The server's JobCheckpoints, timing each save and keeping the last checkpoint."""

    def __init__(self, store) -> None:
        self.store, self.saves, self.last = store, [], None

    @property
    def cadence(self):
        return self.store.cadence

    def save(self, request_id, checkpoint) -> None:
        t0 = time.perf_counter()
        self.store.save(request_id, checkpoint)
        self.saves.append(time.perf_counter() - t0)
        self.last = checkpoint

    def wants(self, request_id) -> bool:
        return self.store.wants(request_id)

    def resume_point(self, request_id, node):
        return self.store.resume_point(request_id, node)

    def resumed(self, request_id, node, step, why) -> None:
        self.store.resumed(request_id, node, step, why)

    def discard(self, request_id) -> None:
        pass  # kept: the resume below reads it


def run(engine, request) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    engine.add_request(request)
    with torch.inference_mode():
        out = engine.run_until_done(request.request_id)
    return out.artifacts["latents"].latents, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "full"))
    ap.add_argument("--shape", default="32x32x5", help="HxWxF")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="the defaults: seconds on a CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from wan_random import save_random_wan

    from omniloop.engine import Engine, EngineConfig
    from omniloop.engine.checkpoints import CheckpointCadence
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
    from omniloop.serve.job_checkpoints import JobCheckpoints

    h, w, f = (int(x) for x in args.shape.split("x"))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipeline = load_pipeline(save_random_wan(size=args.size), LoadOptions(device=device, dtype=dtype))[1]
    request = OmniRequest(task=TaskType.T2V, request_id="job", inputs=[TextPart(text="a red circle moving right")],
                          outputs=OutputSpec(return_latents=True),
                          diffusion=DiffusionParams(seed=3, steps=args.steps, height=h, width=w, num_frames=f))
    sink = open(args.out, "a") if args.out else None
    base = {"bench": "resume", "size": args.size, "shape": args.shape, "steps": args.steps, "device": str(device)}

    run(Engine(pipeline, EngineConfig()), request.model_copy(update={"request_id": "warm"}))
    plain, plain_s = run(Engine(pipeline, EngineConfig()), request)
    with tempfile.TemporaryDirectory() as tmp:
        store = TimedStore(JobCheckpoints(Path(tmp), CheckpointCadence(every_steps=args.every, every_s=None), 2**40))
        engine = Engine(pipeline, EngineConfig())
        engine.checkpoints = store
        with_ck, with_s = run(engine, request)
        last = store.last
        assert last is not None, f"no checkpoint in {args.steps} steps at every {args.every}"
        nbytes = store.store.path("job").stat().st_size
        store.store.adopt({"job"})  # a restart: the job's file becomes resumable
        again = Engine(pipeline, EngineConfig())
        again.checkpoints = store
        resumed, resumed_s = run(again, request)
    emit({**base, "mode": "no_checkpoints", "run_s": plain_s}, sink)
    emit({**base, "mode": "checkpoint_every", "every": args.every, "run_s": with_s,
          "overhead_per_checkpoint_s": (with_s - plain_s) / max(len(store.saves), 1),
          "save_s_median": statistics.median(store.saves), "checkpoint_bytes": nbytes,
          "equal_to_plain": bool(torch.equal(with_ck, plain))}, sink)
    emit({**base, "mode": "resumed", "from_step": last.steps_done, "run_s": resumed_s,
          "saved_fraction": last.steps_done / args.steps, "equal_to_plain": bool(torch.equal(resumed, plain))}, sink)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
