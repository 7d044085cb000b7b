"""Wan2.2 TI2V image-to-video: the peak memory of one DiT forward with the adaLN modulation
per token (diffusers' layout: timestep [B, L] -> modulation [B, L, 6, D], and an fp32 copy of it
in every block) vs per latent frame (timestep [B, F] -> [B, F, 6, D], each row broadcast over
its frame's tokens). The outputs are compared too (bit-equal expected). Each mode runs in a
fresh process so its peak is its own: on the CPU the RSS high-water mark of the forward above
the RSS before it, on the GPU ``max_memory_allocated``. One JSON line per mode.

The DiT is built as the loader builds it (``load_wan_dit``): the parameters in ``--dtype``
except those diffusers keeps in fp32 (``keeps_fp32``: the time embedder, the adaLN tables,
the norms), which stay fp32 -- a wholesale ``model.to(bfloat16)`` would feed the fp32
sinusoidal timestep embedding to a bf16 time embedder, a model no load path makes.

    python benchmarks/bench_ti2v_modulation_memory.py               # CPU: tiny widths, many tokens, fp32
    python benchmarks/bench_ti2v_modulation_memory.py --dtype bfloat16 --height 64 --width 64 --frames 9
                                                                    # CPU: the GPU run's bf16 path, small
    python benchmarks/bench_ti2v_modulation_memory.py --five-b      # GPU: the 5B at 704x1280x121, bf16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import built_in, emit, jsonl_sink  # benchmarks/ is on sys.path when this runs as a script

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json
TI2V_5B = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
           "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
           "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
# tiny widths (D = 128), the 5B's patching: many tokens make the per-token modulation dominate
TINY = {**TI2V_5B, "num_attention_heads": 4, "attention_head_dim": 32, "text_dim": 32, "freq_dim": 16,
        "ffn_dim": 128, "num_layers": 2}


def _rss_bytes() -> int:
    """The resident set now, after handing freed heap back to the OS (``malloc_trim``): memory
    freed while building the model, kept resident and reused by the forward, would otherwise
    hide part of the forward's peak."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# glibc raises its mmap threshold to the size of each large block freed, after which blocks of
# that size come from the heap and stay resident when freed (the CPU peak then depends on the
# order of frees, ~±40% run to run); a fixed threshold maps every large tensor and unmaps it on
# free, so the RSS follows the live tensors.
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _build_dit(cfg: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights, seeded, created in ``dtype`` on ``device`` (no fp32 copy of the 5B),
    then the parameters the loader keeps fp32 upcast (``load_wan_dit``'s precision)."""
    from omniloop.models.families.wan.model import WanDiT, WanDiTConfig, keeps_fp32

    torch.manual_seed(0)
    model = built_in(torch.device(device), dtype, lambda: WanDiT(WanDiTConfig(**cfg)))
    for name, param in model.named_parameters():
        if keeps_fp32(name):
            param.data = param.data.float()
    return model


def _one_mode(mode: str, five_b: bool, dtype: torch.dtype, height: int, width: int, frames: int, batch: int,
              out_file: str) -> dict:
    """One forward in this process; the output is saved to ``out_file`` for the comparison."""
    from omniloop.models.families.wan.ti2v import frame_timestep_mask, token_timestep_mask

    cuda = five_b and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = TI2V_5B if five_b else TINY
    model = _build_dit(cfg, device, dtype)
    g = torch.Generator(device).manual_seed(1)
    shape = (batch, 48, (frames - 1) // 4 + 1, height // 16, width // 16)
    x = torch.randn(shape, device=device, dtype=dtype, generator=g)
    text = torch.randn(batch, 512 if five_b else 16, cfg["text_dim"], device=device, dtype=dtype, generator=g)
    patch = tuple(cfg["patch_size"])
    mask = (token_timestep_mask if mode == "per_token" else frame_timestep_mask)(shape, patch, True, device)
    # [B, L] or [B, F'] float32 (Ti2vDenoiser's dtype, whatever the model's): the first frame at t = 0
    timestep = mask.expand(batch, -1) * 700.0
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _rss_bytes()
        out = model(x, timestep, text)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    torch.save(out.cpu(), out_file)
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    tokens = shape[2] * (shape[3] // patch[1]) * (shape[4] // patch[2])
    return {"bench": "ti2v_modulation_memory", "mode": mode, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype), "shape": [height, width, frames], "batch": batch, "tokens": tokens, "dim": d,
            "timestep_rows": timestep.shape[1], "forward_peak_mib": round(peak / 2**20, 1)}


def _head_and_tail(text: str, keep: int = 6000) -> str:
    """``text`` whole, or its first and last ``keep`` characters around a note of the cut (a
    traceback's head names the call that failed, its tail the error)."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n... [{len(text) - 2 * keep} characters cut] ...\n{text[-keep:]}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--five-b", action="store_true", help="the 5B architecture at 704x1280x121 (a GPU)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--batch", type=int, default=2, help="rows of one forward (2: a CFG pair)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the DiT's compute dtype (default: bfloat16 for --five-b on a GPU, else float32)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--_mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_tensor", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    height = args.height or (704 if args.five_b else 512)
    width = args.width or (1280 if args.five_b else 512)
    frames = args.frames or (121 if args.five_b else 81)
    dtype_name = args.dtype or ("bfloat16" if args.five_b and torch.cuda.is_available() else "float32")
    if args._mode:  # a child: one mode, its record on stdout
        record = _one_mode(args._mode, args.five_b, DTYPES[dtype_name], height, width, frames, args.batch, args._tensor)
        print(json.dumps(record))
        return
    records, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp, jsonl_sink(args.out) as sink:
        for mode in ("per_token", "per_frame"):
            tensor = str(Path(tmp) / f"{mode}.pt")
            child = [sys.executable, __file__, "--_mode", mode, "--_tensor", tensor, "--height", str(height),
                     "--width", str(width), "--frames", str(frames), "--batch", str(args.batch), "--dtype", dtype_name]
            child += ["--five-b"] if args.five_b else []
            done = subprocess.run(child, capture_output=True, text=True, env=CHILD_ENV)
            if done.returncode:  # the child's whole traceback (head and tail), not only its exit status
                sys.exit(f"{mode} run failed (exit {done.returncode}): {' '.join(child)}\n{_head_and_tail(done.stderr)}")
            line = done.stdout.strip().splitlines()[-1]
            records[mode], outputs[mode] = json.loads(line), torch.load(tensor)
            emit(records[mode], sink)
        emit({"bench": "ti2v_modulation_memory", "mode": "comparison",
              "bit_equal": bool(torch.equal(outputs["per_token"], outputs["per_frame"])),
              "max_abs_diff": (outputs["per_token"].float() - outputs["per_frame"].float()).abs().max().item(),
              "peak_ratio": round(records["per_frame"]["forward_peak_mib"] / records["per_token"]["forward_peak_mib"], 3)},
             sink)


if __name__ == "__main__":
    sys.exit(main())
