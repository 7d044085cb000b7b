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


def test_flux2_kv_benchmark_smoke(tmp_path):
    """benchmarks/bench_flux2_kv.py --tiny: the three ways' rows; the cached way carries the
    references once (DiT token rows) and equals diffusers' KV transformer calls bit for bit."""
    from tests.bench_modules import bench_module

    out = tmp_path / "flux2_kv.jsonl"
    args = ["--tiny", "--steps", "2", "--refs", "1", "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert bench_module("bench_flux2_kv").main(args) == 0
    rows = {r["way"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"uncached", "cached", "diffusers_kv"}
    ref, img, steps = rows["cached"]["reference_tokens"], rows["cached"]["image_tokens"], rows["cached"]["steps"]
    assert rows["uncached"]["dit_rows"] == steps * (img + ref) and rows["cached"]["dit_rows"] == ref + steps * img
    assert rows["cached"]["max_abs_diff_vs_diffusers_kv"] == 0.0
