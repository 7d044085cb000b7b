"""The engine benchmark's CPU mode runs and reports every comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~35 s of CPU: 18 traces (3 policies x 2 arrival patterns x 3 repeats) and the rest
def test_engine_benchmark_smoke(tmp_path):
    out = tmp_path / "engine.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    benches = {r["bench"] for r in records}
    assert benches == {"engine_overhead", "mixed_trace", "small_requests"}
    mixed = {(r["arrivals"], r["policy"]): r for r in records if r["bench"] == "mixed_trace" and "policy" in r}
    assert set(mixed) == {(a, p) for a in ("t0", "poisson") for p in ("fifo", "fifo_batch", "step_scheduler")}
    assert mixed["t0", "step_scheduler"]["p95_short_s"] < mixed["t0", "fifo"]["p95_short_s"]
    assert mixed["poisson", "fifo"]["rate_req_s"] > 0
    ratios = {(r["arrivals"], r["metric"], r["baseline"]) for r in records if "ratio" in r}
    assert len(ratios) == 2 * 5 * 2  # arrivals x (4 latencies + throughput) x baselines
