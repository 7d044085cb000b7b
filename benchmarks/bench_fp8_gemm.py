"""The Wan2.1-1.3B block GEMMs at 480x832x81 (32,760 tokens): bf16 ``F.linear`` vs our
``Fp8Linear`` (e4m3, per-token activation scales, quantization included), eager and compiled.

    python benchmarks/bench_fp8_gemm.py --out benchmarks/results/fp8_gemm_h200.jsonl
    python benchmarks/bench_fp8_gemm.py --tiny   # CPU smoke

One JSON line per GEMM and variant, then the per-forward total over the 30 blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from common import emit, jsonl_sink, timed
from omniloop.models.layers.fp8_linear import Fp8Linear, quantize_rowwise

# (name, in, out) of one Wan2.1-1.3B block (dim 1536, ffn 8960); cross-attn k/v act on 512 text tokens
BLOCK_GEMMS = [("self_attn.qkv", 1536, 4608), ("self_attn.out", 1536, 1536), ("cross_attn.q", 1536, 1536),
               ("cross_attn.out", 1536, 1536), ("ffn.proj_in", 1536, 8960), ("ffn.proj_out", 8960, 1536)]
BLOCKS = 30


def kernel_only(x: torch.Tensor, fp8: Fp8Linear) -> dict:
    """The e4m3 GEMM alone, activations quantized beforehand: what the quantization costs is
    the gap to ``fp8_compiled``. Row-wise scales (what Fp8Linear uses) and one scale per
    tensor (another kernel family; a per-tensor activation scale needs a global amax)."""
    xq, sx = quantize_rowwise(x)
    w_t, sw = fp8.weight.t(), fp8.weight_scale
    one = torch.ones((), device=x.device, dtype=torch.float32)
    return {"fp8_kernel_rowwise": lambda: torch._scaled_mm(xq, w_t, scale_a=sx, scale_b=sw, out_dtype=x.dtype),
            "fp8_kernel_tensorwise": lambda: torch._scaled_mm(xq, w_t, scale_a=one, scale_b=one, out_dtype=x.dtype)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    tokens = 256 if args.tiny else 32760
    gemms = [(n, i // 16 if args.tiny else i, o // 16 if args.tiny else o) for n, i, o in BLOCK_GEMMS]
    base = {"bench": "fp8_gemm", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "tokens": tokens, "dtype": str(dtype).removeprefix("torch.")}
    with jsonl_sink(args.out) as sink:
        totals: dict[str, float] = {}
        torch.manual_seed(0)
        for name, k, n in gemms:
            linear = nn.Linear(k, n, device=device, dtype=dtype)
            fp8, fp8_tensor = Fp8Linear.from_linear(linear, "row"), Fp8Linear.from_linear(linear, "tensor")
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            errors = {kind: ((m(x).float() - ref).norm() / ref.norm()).item()
                      for kind, m in (("fp8", fp8), ("fp8_tensor", fp8_tensor))}
            modules = {"bf16": linear, "fp8_eager": fp8, "fp8_tensor_eager": fp8_tensor}
            if cuda:
                modules |= {"fp8_compiled": torch.compile(fp8), "fp8_tensor_compiled": torch.compile(fp8_tensor),
                            "bf16_compiled": torch.compile(linear)}
            variants = {variant: (lambda m=m: m(x)) for variant, m in modules.items()}  # one call path for all
            variants |= kernel_only(x, fp8)
            flops = 2 * tokens * k * n
            with torch.inference_mode():
                for variant, fn in variants.items():
                    s = statistics.median(timed(fn, warmup=3, iters=args.iters, cuda=cuda))
                    totals[variant] = totals.get(variant, 0.0) + s
                    emit({**base, "gemm": name, "k": k, "n": n, "variant": variant, "median_s": s,
                          "tflops": round(flops / s / 1e12, 1),
                          "rel_l2_vs_fp32": errors.get(variant.rsplit("_", 1)[0]) if "kernel" not in variant else None},
                     sink)
        for variant, s in totals.items():
            emit({**base, "gemm": "per_forward_total", "variant": variant, "blocks": BLOCKS,
                  "seconds_per_forward": round(BLOCKS * s, 4)}, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
