"""Wan2.2 TI2V-5B: our DiT forward with per-token timesteps (image-to-video: first-frame tokens
at t=0) vs diffusers' ``WanTransformer3DModel``, side by side in one run on the same random
weights and inputs; plus the peak memory of each (the per-token adaLN modulation is
``[B, L, 6, D]`` fp32 in both). One JSON line per measurement.

    python benchmarks/bench_wan_ti2v.py                # GPU: the 5B architecture at 704x1280x121
    python benchmarks/bench_wan_ti2v.py --tiny         # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from common import emit, jsonl_sink, timed  # benchmarks/ is on sys.path when this runs as a script
from wan_random import random_pair
from omniloop.models.families.wan.ti2v import token_timestep_mask
from omniloop.models.families.wan.weights import load_wan_dit

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json
TI2V_5B = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
           "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
           "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
TINY = {**TI2V_5B, "num_attention_heads": 2, "attention_head_dim": 12, "text_dim": 32, "freq_dim": 16,
        "ffn_dim": 32, "num_layers": 2, "rope_max_seq_len": 64}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = TINY if args.tiny else TI2V_5B
    height, width, frames, text_len = (64, 64, 9, 16) if args.tiny else (704, 1280, 121, 512)
    iters = args.iters or (2 if args.tiny else 5)

    from diffusers import WanTransformer3DModel

    ref, ours = random_pair(WanTransformer3DModel, cfg, load_wan_dit, device, dtype, prefix="wan_ti2v_bench_")

    shape = (1, 48, (frames - 1) // 4 + 1, height // 16, width // 16)
    x = torch.randn(shape, device=device, dtype=dtype)
    text = torch.randn(1, text_len, cfg["text_dim"], device=device, dtype=dtype)
    timestep = token_timestep_mask(shape, tuple(cfg["patch_size"]), True, device) * 700.0  # [1, L]
    with jsonl_sink(args.out) as sink:
        for name, run in (("diffusers", lambda: ref(x, timestep, text, return_dict=False)[0]),
                          ("ours", lambda: ours(x, timestep, text))):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                times = timed(run, warmup=1, iters=iters, cuda=cuda)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            emit({"bench": "wan_ti2v_forward", "impl": name, "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "shape": [height, width, frames], "tokens": timestep.shape[1], "median_s": statistics.median(times),
                  "peak_gib": peak}, sink)
        with torch.inference_mode():
            diff = (ref(x, timestep, text, return_dict=False)[0].float() - ours(x, timestep, text).float()).abs().max()
        emit({"bench": "wan_ti2v_forward", "impl": "agreement", "max_abs_diff": diff.item()}, sink)


if __name__ == "__main__":
    sys.exit(main())
