"""The cache benchmark's CPU mode runs and reports every method and the hook overhead."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cache", ROOT / "benchmarks" / "bench_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_cache_benchmark_smoke(tmp_path):
    out = tmp_path / "cache.jsonl"
    _bench().main(["--tiny", "--size", "16", "16", "--frames", "1", "--steps", "8", "--max-settings", "1",
                "--overhead-rounds", "1", "--overhead-steps", "8", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["bench"] == "note" and "random weights" in records[0]["note"]
    cache = {r["method"]: r for r in records if r["bench"] == "cache"}
    assert set(cache) == {"none", "fbcache", "dbcache", "dbcache+taylorseer", "taylorseer", "teacache"}
    for method, r in cache.items():
        if method != "none":
            assert r["speedup"] > 0 and 0 <= r["skip_ratio"] <= 1 and r["psnr"] > 0 and 0 < r["ssim"] <= 1
    overhead = {r["variant"]: r for r in records if r["bench"] == "hook_overhead"}
    assert len(overhead) == 5 and overhead["baseline (no plugins)"]["overhead_pct"] == 0.0


def test_cache_benchmark_adherence_mode(tmp_path):
    out = tmp_path / "adherence.jsonl"
    _bench().main(["--tiny", "--size", "32", "32", "--frames", "5", "--steps", "6", "--max-settings", "1",
                "--adherence", "3", "--adherence-batch", "2", "--skip", "cache", "--skip", "overhead",
                "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines() if '"cache_adherence"' in line]
    assert {r["method"] for r in records} == {"none", "fbcache", "dbcache", "dbcache+taylorseer", "taylorseer",
                                              "teacache"}
    for r in records:
        assert r["prompts"] == 3 and all(0 <= r[k] <= 1 for k in ("color", "shape", "motion", "all_correct"))
        assert (r["method"] == "none") == ("mean_psnr" not in r)


def test_cache_benchmark_runs_a_chosen_subset_of_the_shipped_model_on_the_cpu(tmp_path):
    out = tmp_path / "shapes.jsonl"
    _bench().main(["--cpu", "--checkpoint", "shapes-t2v", "--size", "32", "32", "--frames", "1", "--steps", "10",
                   "--repeats", "1", "--methods", "taylorseer", "teacache", "--settings", "2",
                   "--skip", "overhead", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["weights"] == "checkpoint" and records[0]["arch"] == "Wan 8 blocks x 256"
    cache = [(r["method"], r["setting"]) for r in records if r["bench"] == "cache"]
    assert [m for m, _ in cache] == ["none", "taylorseer", "teacache"]
    assert "interval 3" in cache[1][1] and "3.0 x median" in cache[2][1]  # the second of each method
