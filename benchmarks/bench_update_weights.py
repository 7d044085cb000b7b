"""The weight plane's costs (issue 31 item 5/8): ``Engine.update_weights`` in place (a state
dict on the device: library mode), from a safetensors file (the served model's
``transformer/*.safetensors``: what ``POST /v1/weights`` reads), and the engine's own module
(no copy); ``sleep(1)`` / ``sleep(2)`` / ``wake()``: device memory returned and the time.

Random-weight Wan checkpoint in the diffusers layout (``wan_random.py``): ``--size tiny`` runs
on 2 CPU cores in seconds; ``--size full`` is the Wan2.1-T2V-1.3B architecture (run it on the
GPU: ``python benchmarks/bench_update_weights.py --size full --device cuda --dtype bfloat16``).
Prints JSON lines; ``--out FILE`` appends them there too.

Each record also checks the contract it times: after each swap-and-swap-back and after each
wake, a 2-step generation's latents are ``torch.equal`` to the original (``bit_equal``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, jsonl_sink  # noqa: E402
from wan_random import SIZES, save_random_wan  # noqa: E402

from omniloop.engine import Engine, EngineConfig  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart  # noqa: E402

CKPT = "transformer/diffusion_pytorch_model.safetensors"


def _device_bytes(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _latents(engine: Engine, n: int, size: int, frames: int) -> torch.Tensor:
    r = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle moving right")],
                    outputs=OutputSpec(return_latents=True), request_id=f"check-{n}",
                    diffusion=DiffusionParams(seed=0, steps=2, height=size, width=size, num_frames=frames))
    engine.add_request(r)
    with torch.inference_mode():
        out = engine.run_until_done(r.request_id)
    engine.pop_output(r.request_id)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents.cpu()


def run(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    folder = Path(args.model) if args.model else save_random_wan(size=args.size)
    pipeline = load_pipeline(folder, LoadOptions(device=device, dtype=dtype))[1]
    engine = Engine(pipeline, EngineConfig())
    dit = pipeline.components["transformer"]
    nbytes = sum(t.numel() * t.element_size() for t in dit.state_dict().values())
    base = {"bench": "update_weights", "size": args.size, "device": str(device), "dtype": args.dtype,
            "dit_bytes": nbytes, "dit_params": sum(p.numel() for p in dit.parameters())}
    size, frames = (args.height, args.frames)
    ref = _latents(engine, 0, size, frames)
    version = 0

    def update(source: object, label: str) -> float:
        nonlocal version
        version += 1
        _sync(device)
        t0 = time.perf_counter()
        info = engine.update_weights(source, str(version))
        _sync(device)
        total = time.perf_counter() - t0
        emit({**base, "op": label, "seconds": total, "copy_seconds": info.seconds, "copied_tensors": info.copied_tensors,
              "GB_per_s": nbytes / info.seconds / 1e9 if info.copied_tensors and info.seconds else None}, args.sink)
        return total

    original = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    perturbed = {k: v + 0.01 if v.is_floating_point() else v for k, v in original.items()}
    for i in range(args.iters):
        update(perturbed, "in_place_state_dict")  # same device, our names: one copy_ per tensor
        update(original, "in_place_state_dict")
    emit({**base, "op": "check_after_swaps", "bit_equal": bool(torch.equal(_latents(engine, 1, size, frames), ref))},
         args.sink)
    for i in range(args.iters):
        update(folder / CKPT, "from_file")  # read (checkpoint names, fused q/k/v) + check + copy
    update(dit, "own_module")  # library mode: the trainer's module is the engine's
    del perturbed
    for level in (1, 2):
        _sync(device)
        before = _device_bytes(device)
        t0 = time.perf_counter()
        slept = engine.sleep(level)
        _sync(device)
        sleep_s = time.perf_counter() - t0
        asleep = _device_bytes(device)
        t0 = time.perf_counter()
        engine.wake()
        _sync(device)
        wake_s = time.perf_counter() - t0
        equal = bool(torch.equal(_latents(engine, 2 + level, size, frames), ref))
        emit({**base, "op": f"sleep_wake_level{level}", "sleep_seconds": sleep_s, "wake_seconds": wake_s,
              "device_bytes_before": before, "device_bytes_asleep": asleep, "released_bytes": before - asleep,
              "reported_released_bytes": slept.released_bytes, "components": list(slept.components),
              "bit_equal": equal}, args.sink)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--model", help="a diffusers Wan folder instead of a random one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--height", type=int, default=32, help="check generation's size (square)")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    with jsonl_sink(args.out) as args.sink:
        run(args)


if __name__ == "__main__":
    main()
