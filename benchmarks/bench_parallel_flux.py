"""Flux parallel figures, 1 rank vs N ranks (JSON lines): one packed forward of the Flux DiT
(random weights, the FLUX.1-dev architecture) on one GPU, then with each axis of its plan
(``ulysses``: the single-stream blocks' tokens split, the double-stream blocks whole on
every rank; ``tp``: Megatron over every block) over N ranks. Scaling efficiency = one-GPU
time / (N x N-rank time); rel. L2 of the N-rank output vs the one-GPU one.

    python benchmarks/bench_parallel_flux.py --tiny                    # CPU: 2 gloo ranks, toy sizes
    python benchmarks/bench_parallel_flux.py                           # 2 GPUs: FLUX.1-dev at 1024x1024
    python benchmarks/bench_parallel_flux.py --sizes 1024x1024,768x1344   # a packed batch of two sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import _timed  # noqa: E402
from common import built_in, emit, jsonl_sink  # noqa: E402
from omniloop.models.families.flux.presets import FLUX1_DEV  # noqa: E402

AXES = ("ulysses", "tp")
TINY_ARCH = {**FLUX1_DEV, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
             "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 24,
             "axes_dims_rope": (4, 6, 6)}


def _build(arch: dict, device: torch.device, dtype: torch.dtype):
    """Random weights, seeded: every rank builds the same model."""
    from omniloop.models.families.flux.model import FluxConfig, FluxTransformer

    torch.manual_seed(0)
    return built_in(device, dtype, lambda: FluxTransformer(FluxConfig(**arch)))


def _inputs(arch: dict, sizes, text_len: int, device, dtype):
    """One packed forward: a sample per (height, width) in pixels (16 px per 2x2-packed token)."""
    from omniloop.models.families.flux.model import FluxInputs
    from omniloop.models.layers.packed import Segments

    g = torch.Generator("cpu").manual_seed(1)
    grids = [(h // 16, w // 16) for h, w in sizes]
    ids = [torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)), indexing="ij"),
                       -1).reshape(-1, 3) for h, w in grids]
    n, tokens = len(sizes), [h * w for h, w in grids]
    return FluxInputs(
        image=torch.randn(sum(tokens), arch["in_channels"], generator=g).to(device, dtype),
        text=torch.randn(n * text_len, arch["joint_attention_dim"], generator=g).to(device, dtype),
        pooled=torch.randn(n, arch["pooled_projection_dim"], generator=g).to(device, dtype),
        timestep=torch.full((n,), 0.5, device=device), guidance=torch.full((n,), 3.5, device=device),
        image_ids=torch.cat(ids).to(device), text_ids=torch.zeros(n * text_len, 3, device=device),
        image_segments=Segments(tuple(tokens)), text_segments=Segments((text_len,) * n))


def step_rank(rank: int, world: int, arch: dict, sizes, text_len: int, axes, warmup: int, iters: int) -> dict:
    """On every rank: rank 0 first times the one-device forward alone, then every axis on all ranks."""
    import torch.distributed as dist

    from omniloop.models.families.flux.parallelize import FLUX_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.spec import ParallelSpec

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = _inputs(arch, sizes, text_len, device, dtype)
    out: dict = {}
    with torch.inference_mode():
        if rank == 0:
            model = _build(arch, device, dtype)
            reference = model(inputs).float()
            out["one"] = _timed(lambda: model(inputs), warmup, iters, device, all_ranks=False)
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        for axis in axes:
            model = _build(arch, device, dtype)
            parallelize_model(model, FLUX_PARALLEL, ParallelMesh.build(ParallelSpec(**{axis: world}), device))
            first = model(inputs)
            if rank == 0:
                out[f"rel_l2[{axis}]"] = ((first.float() - reference).norm() / reference.norm()).item()
            out[axis] = _timed(lambda: model(inputs), warmup, iters, device, all_ranks=True)
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke: 2 gloo ranks, toy sizes")
    p.add_argument("--sizes", default=None, help="comma-separated HxW pixels of the packed samples (default 1024x1024)")
    p.add_argument("--text-len", type=int, default=None, help="T5 tokens per sample (default 512)")
    p.add_argument("--axes", default=",".join(AXES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from omniloop.parallel.launch import run_on_ranks

    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} are visible")
    arch = FLUX1_DEV if cuda else TINY_ARCH
    sizes = [tuple(int(v) for v in s.split("x")) for s in (args.sizes or ("1024x1024" if cuda else "64x96,96x64")).split(",")]
    text_len = args.text_len or (512 if cuda else 7)
    axes = tuple(a for a in args.axes.split(",") if a)
    results = run_on_ranks(step_rank, args.world, arch, sizes, text_len, axes, args.warmup, args.iters,
                           device="cuda" if cuda else "cpu", timeout_s=1800)
    base = {"bench": "flux_step", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": "bfloat16" if cuda else "float32", "arch": "flux.1-dev" if cuda else "tiny",
            "sizes": [list(s) for s in sizes], "image_tokens": sum(h * w // 256 for h, w in sizes),
            "text_tokens": text_len * len(sizes)}
    with jsonl_sink(args.out) as sink:
        one = statistics.median(results[0]["one"])
        emit({**base, "ranks": 1, "axis": "none", "step_s": one}, sink)
        for axis in axes:
            step = max(statistics.median(r[axis]) for r in results)  # the slowest rank sets the step
            emit({**base, "ranks": args.world, "axis": axis, "step_s": step, "speedup": round(one / step, 3),
                  "efficiency": round(one / step / args.world, 3), "rel_l2_vs_one": results[0][f"rel_l2[{axis}]"]},
                 sink)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
