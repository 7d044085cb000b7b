"""benchmarks/bench_cli_threads.py stays runnable: fresh CLI processes per thread setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_threads_benchmark_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cli_threads.py"), "--tiny", "--repeats",
                           "1", "--settings", "auto", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["setting"] for r in records] == ["auto", "1"]
    for r in records:
        assert r["wall_s"] > r["generate_s"] > 0 and r["load_s"] > 0 and r["cpu_s"] > 0
        assert all(1 <= t <= r["torch_default_threads"] for t in r["auto_threads"])
