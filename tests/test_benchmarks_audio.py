"""benchmarks/bench_audio.py --tiny (CPU smoke): every figure the GPU run reports is produced
over pipelines that really share weights (our tiny LTX-2 equals diffusers' bit for bit, Stable
Audio within the parity tests' 1e-5), and fan-out ran the two decoders together only when on
(CPU timings of the toys are not compared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_modules import bench_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_audio_benchmark_smoke(tmp_path):
    out = tmp_path / "audio.jsonl"
    # one intra-op thread: with two, torch splits some CPU reductions differently for the two
    # pipelines' op shapes, and the tiny LTX-2 then differs by one 8-bit level (measured)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_audio.py"), "--tiny", "--fanout-iters", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    by = {(r["bench"], r.get("mode")): r for r in map(json.loads, out.read_text().splitlines())}
    sa, ltx = by[("stable_audio", None)], by[("ltx2", None)]
    for rec in (sa, ltx):
        assert rec["ours_s"] > 0 and rec["diffusers_s"] > 0 and rec["speedup"] > 0
    assert sa["sample_rate"] == 128 and sa["audio_seconds"] == 2.0 and sa["waveform_max_abs_diff"] <= 1e-5
    assert ltx["frames_max_abs_diff_uint8"] == 0 and ltx["waveform_max_abs_diff"] == 0
    on, off, saving = by[("fanout", "fan_out")], by[("fanout", "serial")], by[("fanout", "saving")]
    assert on["parallel"] and not off["parallel"]
    for rec in (on, off):
        assert rec["decode_node_s"] > 0 and rec["audio_decode_node_s"] > 0 and rec["decode_phase_s"] > 0
    assert {"decode_phase_saved_s", "e2e_saved_s", "decode_phase_ratio", "shorter_decoder_s"} <= set(saving)


def test_audio_benchmark_stops_before_gpu_work_without_torchsde(monkeypatch):
    """The GPU image has no torchsde (Stable Audio's sampler noise, ours and diffusers'): the
    script says what to carry before it builds anything."""
    import importlib.util

    bench_audio = bench_module("bench_audio")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchsde" else real(name, *a))
    with pytest.raises(SystemExit, match=r"stable_audio figure needs torchsde .* or pass --only ltx2 fanout"):
        bench_audio.main(["--tiny", "--only", "stable_audio", "ltx2"])
    bench_audio.check_packages(["ltx2", "fanout"])  # LTX-2 needs no torchsde
