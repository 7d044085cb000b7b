"""Wan VACE: our DiT forward (the control blocks, their hints added at ``vace_layers``) vs
diffusers' ``WanVACETransformer3DModel``, side by side in one run on the same random weights
and inputs (a reference frame in front: control latents one frame longer than the video's),
with the peak memory of each. One JSON line per measurement.

    python benchmarks/bench_wan_vace.py                # GPU: Wan2.1-VACE-1.3B at 480x832x81 + 1 reference
    python benchmarks/bench_wan_vace.py --arch 14b     # GPU: Wan2.1-VACE-14B (bf16 ~35 GB of weights)
    python benchmarks/bench_wan_vace.py --tiny         # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from common import emit, jsonl_sink, timed  # benchmarks/ is on sys.path when this runs as a script
from wan_random import random_pair
from omniloop.models.families.wan.weights import load_wan_dit

# Wan-AI/Wan2.1-VACE-1.3B-diffusers / -14B-diffusers transformer/config.json
VACE_1_3B = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
             "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
             "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
             "vace_layers": list(range(0, 30, 2)), "vace_in_channels": 96}
VACE_14B = {**VACE_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
            "vace_layers": list(range(0, 40, 5))}
TINY = {**VACE_1_3B, "num_attention_heads": 2, "attention_head_dim": 12, "text_dim": 32, "freq_dim": 16,
        "ffn_dim": 32, "num_layers": 4, "rope_max_seq_len": 64, "vace_layers": [0, 2]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--arch", choices=("1.3b", "14b"), default="1.3b")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = TINY if args.tiny else VACE_14B if args.arch == "14b" else VACE_1_3B
    height, width, frames, text_len = (64, 64, 9, 16) if args.tiny else (480, 832, 81, 512)
    iters = args.iters or (2 if args.tiny else 5)

    from diffusers import WanVACETransformer3DModel

    ref, ours = random_pair(WanVACETransformer3DModel, cfg, load_wan_dit, device, dtype, prefix="wan_vace_bench_")

    latent_frames = (frames - 1) // 4 + 1 + 1  # + one reference frame
    x = torch.randn(1, 16, latent_frames, height // 8, width // 8, device=device, dtype=dtype)
    control = torch.randn(1, cfg["vace_in_channels"], latent_frames, height // 8, width // 8, device=device,
                          dtype=dtype)
    text = torch.randn(1, text_len, cfg["text_dim"], device=device, dtype=dtype)
    t = torch.tensor([700.0], device=device)
    scale = torch.ones(len(cfg["vace_layers"]), device=device, dtype=dtype)
    runs = (("diffusers", lambda: ref(x, t, text, control_hidden_states=control, control_hidden_states_scale=scale,
                                      return_dict=False)[0]),
            ("ours", lambda: ours(x, t, text, control_hidden_states=control, control_scale=scale[None])))
    tokens = latent_frames * (height // 16) * (width // 16)
    with jsonl_sink(args.out) as sink:
        for name, run in runs:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                times = timed(run, warmup=1, iters=iters, cuda=cuda)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            emit({"bench": "wan_vace_forward", "impl": name, "arch": "tiny" if args.tiny else args.arch,
                  "device": torch.cuda.get_device_name() if cuda else "cpu", "shape": [height, width, frames],
                  "tokens": tokens, "median_s": statistics.median(times), "peak_gib": peak}, sink)
        with torch.inference_mode():
            diff = (runs[0][1]().float() - runs[1][1]().float()).abs().max()
        emit({"bench": "wan_vace_forward", "impl": "agreement", "max_abs_diff": diff.item()}, sink)


if __name__ == "__main__":
    sys.exit(main())
