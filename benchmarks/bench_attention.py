"""Attention kernels at the Wan2.1-1.3B shape (32,760 tokens x 12 heads x 128), side by side:
our registry's SDPA backends and, when installed, third-party low-precision kernels.
Prints JSON lines: median seconds, TFLOP/s, and the error vs a float32 reference on a
slice of queries. This is the data behind the attention-backend choice for the DiT.

    python benchmarks/bench_attention.py [--tokens 32760] [--heads 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from common import emit, jsonl_sink, timed


def median_s(fn) -> float:
    return statistics.median(timed(fn, warmup=5, iters=20, cuda=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32760)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omniloop.models.layers.attention import attention

    L, H, D = args.tokens, args.heads, args.head_dim
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, L, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * L * L * D * H
    # float32 reference on the first 1024 queries
    qs = q[:, :1024].float().transpose(1, 2)
    ref = F.scaled_dot_product_attention(qs, k.float().transpose(1, 2), v.float().transpose(1, 2)).transpose(1, 2)

    def err(out):
        o = out[:, :1024].float()
        return ((o - ref).norm() / ref.norm()).item()

    candidates = {f"registry:{b}": (lambda b=b: attention(q, k, v, backend=b))
                  for b in ("sdpa", "sdpa_cudnn", "sdpa_flash", "triton_8bit", "cudnn_fp8")}
    # cuDNN FP8 split: the kernel alone on prepared operands, and preparation + kernel +
    # dequantization compiled as one graph (as inside a compiled block)
    from omniloop.models.layers.attention_cudnn_fp8 import fp8_attention, prepare, sdpa_fp8

    ops = prepare(q, k, v)  # once, outside the timing
    fp8_compiled = torch.compile(fp8_attention)
    candidates["cudnn_fp8:kernel_only"] = lambda: sdpa_fp8(ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale,
                                                           ops.v_scale, ops.o_scale)
    candidates["cudnn_fp8:compiled"] = lambda: fp8_compiled(q, k, v)
    from omniloop.models.layers.attention_8bit import quantize_qkv, tuned_tiles
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name, backend in (("sdpa:cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa:flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa:efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        candidates[name] = run
    try:
        from sageattention import sageattn

        candidates["sageattention1:int8qk"] = lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
    except ImportError as e:
        print(f"sageattention unavailable: {e}", file=sys.stderr)
    with jsonl_sink(args.out) as sink:
        for name, fn in candidates.items():
            try:
                out = fn()
                if name == "cudnn_fp8:kernel_only":  # e4m3 O in its scale: error read after dequantization
                    out = ops.dequantize(out, torch.float32)
                seconds = median_s(fn)
                rec = {"bench": "attention", "kernel": name, "tokens": L, "heads": H, "head_dim": D,
                       "median_s": seconds, "tflops": round(flops / seconds / 1e12, 1), "rel_err_vs_fp32": err(out),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__}
            except Exception as e:  # a kernel that cannot run here is reported, not fatal
                rec = {"bench": "attention", "kernel": name, "error": f"{type(e).__name__}: {e}"[:300]}
            if name == "registry:triton_8bit" and "error" not in rec:
                rec["autotuned_tiles"] = tuned_tiles()
                rec["quantize_s"] = median_s(lambda: quantize_qkv(q, k, v))  # the prepass, inside median_s
            emit(rec, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
