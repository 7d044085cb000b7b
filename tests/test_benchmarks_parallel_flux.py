"""bench_parallel_flux.py --tiny: the 2-rank CPU smoke of the Flux parallel figures (the GPU
mode is the same code on NCCL with the FLUX.1-dev architecture at 1024x1024)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_flux_parallel_benchmark_smoke(tmp_path):
    out = tmp_path / "flux.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_parallel_flux.py"), "--tiny", "--iters", "1",
                           "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = {r["axis"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"none", "ulysses", "tp"}
    assert records["ulysses"]["rel_l2_vs_one"] == 0.0  # fp32 Ulysses: bitwise
    assert 0 < records["tp"]["rel_l2_vs_one"] < 1e-5
    assert all(r["step_s"] > 0 for r in records.values())
