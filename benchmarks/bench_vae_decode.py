"""The Wan2.1 VAE decode (issue 34 item 4): which execution of the same decoder is fastest.

One random Wan2.1 VAE (diffusers' ``AutoencoderKLWan``, seeded, loaded by our ``load_wan_vae``),
one latent of the requested video size, and the same decode run several ways, side by side:

- ``diffusers``: ``AutoencoderKLWan.decode`` (one latent frame per chunk, a feature cache);
- ``ours chunk 1``: our decoder, one latent frame per chunk (bit-equal to diffusers' order of work);
- ``ours chunk k``: the first latent frame alone, then latent frames [1, k), [k, 2k), ... a chunk
  each (``WanVAE.decode(chunk_frames=k)``; fewer, larger convolutions; the same function up to
  float rounding: every layer is causal through the cache). NOTE: ``vae_decode_h100.jsonl`` was
  measured with the chunks [1, k+1), [k+1, 2k+1), ... (the boundaries moved to multiples of k
  afterwards, to match a decode loop stepping k frames at a time);
- ``whole``: every latent frame in one chunk (when it fits);
- each with cuDNN's autotuner (``torch.backends.cudnn.benchmark``) off and on, and with the
  decoder's weights and activations in ``channels_last_3d``;
- ``compiled``: ``torch.compile`` of the decoder at the best chunk size (optional, slow to build);
- ``fused``: ``WanVAE.use_fused`` (each norm -> SiLU -> causal conv input in one compiled pass,
  the convs eager) at the best chunk size and at chunk 1 (optional; compile time reported apart).

Every row: median seconds, peak memory, and max |diff| against ours chunk 1 (in [-1, 1]).

    python benchmarks/bench_vae_decode.py --out benchmarks/results/vae_decode_h100.jsonl
    python benchmarks/bench_vae_decode.py --tiny          # CPU smoke
    python benchmarks/bench_vae_decode.py --no-diffusers --fused --out benchmarks/results/vae_decode_fused_h100.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import IO, Callable, cast

import torch

from common import emit, jsonl_sink, profile_top, timed  # benchmarks/ is on sys.path when this runs as a script
from omniloop.models.autoencoders.wan_vae import FUSED_KERNELS, FusedKernel, WanVAE
from wan_random import random_wan_vaes


@dataclass(frozen=True)
class Variant:
    name: str
    chunk_frames: int | None  # None: whole
    cudnn_benchmark: bool
    channels_last: bool = False


def variants(chunks: list[int], quick: bool = False) -> list[Variant]:
    """Every way to time; ``quick``: chunk 1 and ``chunks`` with cuDNN's autotuner on, nothing else."""
    rows = [Variant("chunk1", 1, True)] if quick else [Variant("chunk1", 1, False), Variant("chunk1", 1, True)]
    rows += [Variant(f"chunk{k}", k, True) for k in chunks if k != 1]
    if quick:
        return rows
    rows += [Variant("whole", None, True)]
    rows += [Variant("chunk1", 1, True, True)] + [Variant(f"chunk{k}", k, True, True) for k in chunks if k != 1]
    return rows


def set_layout(module: torch.nn.Module, fmt: torch.memory_format) -> None:
    """The 3D conv weights in ``fmt`` (``Module.to(memory_format=)`` refuses the 2D convs' 4-D weights)."""
    for param in module.parameters():
        if param.dim() == 5:
            param.data = param.data.contiguous(memory_format=fmt)


def decode_fn(vae: WanVAE, z: torch.Tensor, v: Variant) -> Callable[[], torch.Tensor]:
    if v.chunk_frames is None:
        return lambda: vae.decode(z, whole=True)
    return lambda: vae.decode(z, chunk_frames=v.chunk_frames)


def measure_fused(vae: WanVAE, z: torch.Tensor, best: Variant, base: dict, sink: IO[str] | None,
                  measure: Callable[[str, Callable[[], torch.Tensor], dict], object], kernel: FusedKernel) -> None:
    """The fused norm -> SiLU -> padding pass (``kernel``) at ``best``'s chunk size and at chunk 1
    (cuDNN as in ``best``, contiguous layout): the first decode of each, which compiles, timed apart.
    Rows are named ``fused_<chunk>`` for Inductor, ``fused_<kernel>_<chunk>`` otherwise."""
    vae.use_fused(True, kernel=kernel)
    tag = "fused" if kernel == "inductor" else f"fused_{kernel}"
    for v in dict.fromkeys([Variant(best.name, best.chunk_frames, best.cudnn_benchmark),
                            Variant("chunk1", 1, best.cudnn_benchmark)]):
        fn = decode_fn(vae, z, v)
        t0 = time.perf_counter()
        fn()
        emit({**base, "variant": f"{tag}_compile_seconds_{v.name}", "seconds": round(time.perf_counter() - t0, 1)},
             sink)
        measure(f"{tag}_{v.name}", fn, {"chunk_frames": v.chunk_frames, "cudnn_benchmark": v.cudnn_benchmark,
                                        "fused": kernel})
    vae.use_fused(False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a small VAE and video on the CPU (smoke)")
    p.add_argument("--shape", default="480x832x81", help="HxWxF of the decoded video")
    p.add_argument("--chunks", default="2,4,5,10", help="latent frames per chunk after the first, to try")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(decoder) at the best chunk")
    p.add_argument("--fused", action="store_true",
                   help="also time WanVAE.use_fused (norm + SiLU + causal padding in one pass) at the best "
                        "chunk and at chunk 1")
    p.add_argument("--fused-kernels", default="inductor",
                   help="with --fused: the kernels to time, comma separated (inductor, triton: CUDA only)")
    p.add_argument("--profile", action="store_true", help="top kernels of chunk 1 and of the best variant")
    p.add_argument("--quick", action="store_true",
                   help="only chunk 1 and --chunks (cuDNN autotuner on): no whole video, no channels-last")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    height, width, frames = (64, 64, 9) if args.tiny else tuple(int(x) for x in args.shape.split("x"))
    ref, vae = random_wan_vaes(device, dtype, tiny=args.tiny)
    latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    z = torch.randn(latent, generator=torch.Generator("cpu").manual_seed(1)).to(device, dtype)
    base = {"bench": "vae_decode", "shape": [height, width, frames], "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}
    chunks = [int(k) for k in args.chunks.split(",") if k]
    kernels = [cast(FusedKernel, k) for k in args.fused_kernels.split(",") if k]
    if unknown := [k for k in kernels if k not in FUSED_KERNELS]:
        raise SystemExit(f"--fused-kernels {unknown}: pass some of {list(FUSED_KERNELS)}")

    def measure(name: str, fn: Callable[[], torch.Tensor], extra: dict) -> tuple[float, torch.Tensor] | None:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            out = fn()  # warm (cuDNN plans, compiled graphs)
            times = timed(fn, warmup=0, iters=args.iters, cuda=cuda)
        except torch.OutOfMemoryError as e:
            emit({**base, "variant": name, **extra, "error": f"OOM: {str(e)[:200]}"}, sink)
            return None
        row = {**base, "variant": name, **extra, "median_s": round(statistics.median(times), 4),
               "times_s": [round(t, 4) for t in times]}
        if cuda:
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if reference is not None:
            row["max_abs_vs_chunk1"] = (out.float() - reference.float()).abs().max().item()
        emit(row, sink)
        return row["median_s"], out

    with jsonl_sink(args.out) as sink, torch.inference_mode():
        reference: torch.Tensor | None = None
        if args.diffusers:
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                measure("diffusers", lambda: ref.decode(z, return_dict=False)[0], {"cudnn_benchmark": bench})
        best: tuple[float, Variant] | None = None
        for v in variants(chunks, quick=args.quick):
            torch.backends.cudnn.benchmark = v.cudnn_benchmark
            if v.channels_last:
                set_layout(vae, torch.channels_last_3d)
            extra = {"chunk_frames": v.chunk_frames, "cudnn_benchmark": v.cudnn_benchmark,
                     "channels_last": v.channels_last}
            got = measure(v.name, decode_fn(vae, z, v), extra)
            if v.channels_last:
                set_layout(vae, torch.contiguous_format)
            if got is None:
                continue
            if reference is None:
                reference = got[1]
            # the best chunked way (what a served decode steps: the whole video as one chunk
            # needs 43-49 GB at 480x832x81 and is measured for reference only)
            if v.chunk_frames is not None and (best is None or got[0] < best[0]):
                best = (got[0], v)
        assert best is not None
        emit({**base, "variant": "best", "name": best[1].name, "median_s": best[0], **best[1].__dict__}, sink)
        torch.backends.cudnn.benchmark = best[1].cudnn_benchmark
        if args.fused:  # before --compile, which replaces the decoder
            for kernel in kernels:
                measure_fused(vae, z, best[1], base, sink, measure, kernel)
        if args.compile and best[1].chunk_frames is not None:
            t0 = time.perf_counter()
            vae.decoder = torch.compile(vae.decoder)  # type: ignore[assignment]
            first = decode_fn(vae, z, best[1])
            first()
            emit({**base, "variant": "compile_seconds", "seconds": round(time.perf_counter() - t0, 1)}, sink)
            measure(f"compiled_{best[1].name}", first, {"chunk_frames": best[1].chunk_frames, "compiled": True})
        if args.profile:
            for v in (Variant("chunk1", 1, True), best[1]):
                rows = profile_top(decode_fn(vae, z, v), cuda=cuda, steps=1, top=12)
                emit({**base, "variant": f"profile_{v.name}", "top": rows}, sink)
            for kernel in kernels if args.fused else ():
                rows = profile_top(decode_fn(vae.use_fused(True, kernel=kernel), z, best[1]), cuda=cuda, steps=1,
                                   top=12)
                emit({**base, "variant": f"profile_fused_{kernel}_{best[1].name}", "top": rows}, sink)
                vae.use_fused(False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
