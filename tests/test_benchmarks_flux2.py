"""benchmarks/bench_flux2.py --tiny (CPU smoke, in process): every row the GPU run reports is
produced, and in fp32 our FLUX.2 forward equals diffusers' bit for bit (CPU timings of the toy
are not compared)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flux2_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_flux2", ROOT / "benchmarks" / "bench_flux2.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "flux2.jsonl"
    assert bench.main(["--tiny", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["references"]) for r in rows] == [(1, 0), (2, 0), (1, 1)]
    assert all(r["max_abs_diff"] == 0.0 and r["ours_s"] > 0 and r["diffusers_s"] > 0 for r in rows)
    assert rows[2]["image_tokens"] == 2 * rows[0]["image_tokens"]  # the reference's tokens ride along
