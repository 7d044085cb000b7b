"""benchmarks/bench_flux.py --tiny (CPU smoke): every figure the GPU run reports is produced,
and the batching each mode claims happened (CPU timings of the toy are not compared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_flux_benchmark_smoke(tmp_path):
    out = tmp_path / "flux.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flux.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["bench"], r.get("mode")): r for r in records}
    mixed = {m: by[("mixed_sizes", m)] for m in ("packed", "same_shape", "one_at_a_time")}
    assert mixed["packed"]["mean_batch"] == mixed["packed"]["requests"]  # every size in every step
    assert 1 < mixed["same_shape"]["mean_batch"] < mixed["packed"]["mean_batch"] and mixed["one_at_a_time"]["mean_batch"] == 1
    assert {"packed_vs_same_shape", "packed_vs_one_at_a_time"} <= set(by[("mixed_sizes", "ratios")])
    lora = {m: by[("lora_burst", m)] for m in ("one_batch", "batch_per_adapter", "no_lora")}
    assert lora["one_batch"]["mean_batch"] == lora["one_batch"]["requests"] and lora["batch_per_adapter"]["mean_batch"] == 1
    cached, uncached = by[("text_cache", "cached")], by[("text_cache", "uncached")]
    assert cached["hit_rate"] > 0.5 and cached["prompts_encoded"] == 2 * cached["distinct_prompts"]
    assert uncached["prompts_encoded"] > cached["prompts_encoded"]
    assert by[("cuda_graphs", None)]["skipped"] == "needs a CUDA device"
    graphs = [r for r in records if r["bench"] == "cuda_graphs_engine" and r["mode"] == "ratios"]
    assert len(graphs) == 2 and all("refused on a CPU" in r["skipped"] and r["outputs_equal"] for r in graphs)
    assert by[("cuda_graphs_engine", "graphs")]["graphs"]["eager_not_cuda"] > 0  # the step reached the runner
