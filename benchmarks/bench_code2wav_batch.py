"""Qwen3-Omni code2wav: windows decoded one a forward (before) vs windows of one length batched
(``decode_windows``, after), on the same random weights in one run; one JSON line per case.

* ``answer``: one non-streamed answer of ``--frames`` frames in transformers' ``chunked_decode``
  windows (300 frames, 25 of left context): the full windows past the first share a forward.
* ``streams``: ``--streams`` concurrent streamed answers, one 25-frame window each (25 of left
  context, 50 frames a forward row) at one engine step.

Each record: wall and CPU seconds (medians of ``--repeats``, the two run alternately) before /
after, the speedups, and the largest sample difference (fp32 reassociation in a batched GEMM /
convolution; not bit-equal).
The decoder is a scaled-down code2wav (``--size small``: hidden 256, 4 layers, decoder 256 wide,
the released upsampling 8 x 5 x 4 x 3 and 2 x 2, 1920 samples a frame) so a CPU run takes
seconds; ``--size released`` is the released model's shape (a GPU run).

    python benchmarks/bench_code2wav_batch.py --threads 1 --out benchmarks/results/code2wav_batch_cpu.jsonl
    python benchmarks/bench_code2wav_batch.py --size released --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, jsonl_sink  # noqa: E402

from omniloop.models.families.qwen3_omni.code2wav import Code2Wav, Code2WavConfig, decode_windows, windows  # noqa: E402

SIZES = {
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, decoder_dim=256),
    "released": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=16, decoder_dim=1536),
}


def model(size: str, device: str, dtype: torch.dtype) -> Code2Wav:
    config = Code2WavConfig.from_hf({"codebook_size": 2048, "num_quantizers": 16, "sliding_window": 72, **SIZES[size]})
    torch.manual_seed(0)
    m = Code2Wav(config).eval()
    with torch.no_grad():  # SnakeBeta / layer scales off their identity init, so the decoder does work
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.to(device, dtype)


def _seconds(fn, device: str) -> tuple[float, float, list[torch.Tensor]]:
    """Wall and CPU (this process's, every thread) seconds of one call, and its output."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0, out


def timed_pair(before, after, repeats: int, device: str) -> tuple[list[tuple[float, float]], list[torch.Tensor],
                                                                   list[torch.Tensor]]:
    """Median (wall, CPU) seconds of ``before`` and of ``after``, run alternately (a shared
    machine's load drifts over a run: alternating spreads it over both; the CPU seconds are what
    the process itself spent, less swayed by other processes), after one warm-up call of each."""
    solo, batched = before(), after()
    times: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    for _ in range(repeats):
        for k, fn in enumerate((before, after)):
            wall, cpu, _ = _seconds(fn, device)
            times[k].append((wall, cpu))
    medians = [(statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times]
    return medians, solo, batched


def case(name: str, m: Code2Wav, codes: list[torch.Tensor], wins: list, args, sink) -> None:
    with torch.inference_mode():
        (before, before_cpu), (after, after_cpu) = (medians := timed_pair(
            lambda: decode_windows(m, codes, wins, max_batch=1),
            lambda: decode_windows(m, codes, wins, max_batch=args.max_batch), args.repeats, args.device))[0]
        solo, batched = medians[1], medians[2]
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(solo, batched))
    lengths = sorted({w.frames for w in wins})
    emit({"bench": "code2wav_batch", "case": name, "size": args.size, "device": args.device, "dtype": args.dtype,
          "threads": torch.get_num_threads(), "windows": len(wins), "window_frames": lengths,
          "max_batch": args.max_batch, "audio_s": sum(w.end - w.start for w in wins) / 12.5,
          "solo_s": round(before, 4), "batched_s": round(after, 4), "speedup": round(before / after, 3),
          "solo_cpu_s": round(before_cpu, 4), "batched_cpu_s": round(after_cpu, 4),
          "cpu_speedup": round(before_cpu / after_cpu, 3),
          "max_abs_diff": diff}, sink)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--frames", type=int, default=1225, help="the non-streamed answer's frames (1225: 98 s)")
    ap.add_argument("--streams", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    m = model(args.size, args.device, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(1)
    with jsonl_sink(args.out) as sink:
        answer = torch.randint(0, 2048, (16, args.frames), generator=g).to(args.device)
        wins = windows(args.frames, 300, 25)
        case("answer", m, [answer] * len(wins), wins, args, sink)
        for n in args.streams:  # each answer's third window: frames 50..75 after 25 of context
            codes = [torch.randint(0, 2048, (16, 75), generator=g).to(args.device) for _ in range(n)]
            case(f"streams_{n}", m, codes, [w for c in codes for w in windows(75, 25, 25)[2:]], args, sink)


if __name__ == "__main__":
    main()
