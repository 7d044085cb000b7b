"""bench_parallel.py --tiny: the 2-rank CPU smoke of the parallelism figures (the GPU mode
is the same code on NCCL at 720p x 81 frames; see docs/architecture.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_parallel_benchmark_smoke(tmp_path):
    out = tmp_path / "parallel.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_parallel.py"), "--tiny", "--iters", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    steps = {r["axis"]: r for r in records if r["bench"] == "step"}
    assert set(steps) == {"none", "ulysses", "ring", "cfg", "tp"}
    for axis in ("ulysses", "ring", "cfg", "tp"):
        assert steps[axis]["step_s"] > 0 and steps[axis]["efficiency"] > 0
        assert steps[axis]["rel_l2_vs_one"] < 1e-5, (axis, steps[axis]["rel_l2_vs_one"])  # fp32: same model
    e2e = {r["parallel"]: r for r in records if r["bench"] == "e2e"}
    assert set(e2e) == {"one", "cfg=2", "ulysses=2,vae=tiles,vae_tile=16,vae_stride=8"}
    assert all(r["seconds"] > 0 for r in e2e.values()) and "speedup" in e2e["cfg=2"]
    mixed = {r["parallel"]: r for r in records if r["bench"] == "mixed_trace"}
    assert set(mixed) == {"one", "cfg=2"}
    assert all(r["n_short"] == 2 and r["p95_short_s"] < r["p95_long_s"] for r in mixed.values())
