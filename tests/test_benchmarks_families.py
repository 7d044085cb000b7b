"""benchmarks/bench_families.py --tiny (CPU smoke): each side's row comes out with its agreement
beside its time, our pipelines equal diffusers' on the same random weights, and both DBCaches
follow the one forced schedule (the same cached steps, the same output) - on Wan2.1 (a
checkpoint on disk) and Flux (diffusers' pipeline over our tensors, whose DiT takes no block
interceptor: its cache row says why it was skipped). CPU timings of the toys are not compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_modules import bench_module

ROOT = Path(__file__).resolve().parents[1]
LEVEL = 1 / 255 + 1e-6  # one uint8 level: fp32 rounding may flip a pixel's last level


@pytest.mark.slow
def test_families_benchmark_smoke(tmp_path):
    out = tmp_path / "families.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_families.py"), "--tiny", "--only", "wan21,flux",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(r["family"], r["mode"]): r for r in map(json.loads, out.read_text().splitlines())}
    for family, output in (("wan21", "video"), ("flux", "image")):
        for mode in ("diffusers", "diffusers_compiled", "diffusers_cache_dit", "ours_default"):
            row = rows[(family, mode)]
            assert row["status"] == "ok" and row["median_s"] > 0 and row["times_s"], row
        for mode in ("diffusers_compiled", "ours_default", "ours_eager"):  # exact paths: equal to plain diffusers
            assert rows[(family, mode)]["agreement_vs_diffusers"][output]["max_abs_diff"] <= LEVEL
            mean, ref = rows[(family, mode)]["output_mean"][output], rows[(family, "diffusers")]["output_mean"][output]
            assert 0 < mean < 1 and abs(mean - ref) <= LEVEL  # a picture, at diffusers' level
        fp8 = rows[(family, "ours_fp8")]
        assert fp8["status"] == "skipped" and "CUDA" in fp8["reason"]
        assert "ours_default_over_diffusers" in rows[(family, "speedups")]["speedup"]
        assert rows[(family, "ours_eager")]["compile"] is False  # the explicit kernels, named in the row
        assert "ours_default_over_ours_eager" in rows[(family, "speedups")]["speedup"]
    ours, theirs = rows[("wan21", "ours_cache")], rows[("wan21", "diffusers_cache_dit")]
    assert ours["status"] == "ok" and ours["schedule"] == theirs["schedule"]
    assert ours["cached_steps"] == theirs["cached_steps"] == theirs["cached_uncond_steps"] > 0
    a, b = ours["agreement_vs_diffusers"]["video"], theirs["agreement_vs_diffusers"]["video"]
    assert a["psnr_db"] < 80 and abs(a["psnr_db"] - b["psnr_db"]) < 0.5  # skipping changed the video, alike
    assert abs(a["max_abs_diff"] - b["max_abs_diff"]) <= LEVEL
    assert rows[("flux", "diffusers_cache_dit")]["cached_steps"] > 0
    skipped = rows[("flux", "ours_cache")]
    assert skipped["status"] == "skipped" and "block_interceptor" in skipped["reason"]


def test_families_benchmark_names_unknown_choices(capsys):
    bench_families = bench_module("bench_families")
    with pytest.raises(SystemExit):
        bench_families.parse(["--tiny", "--modes", "ours,diffusers"])
    assert "--modes: unknown ['ours']; pass some of diffusers,diffusers_compiled," in capsys.readouterr().err
    args = bench_families.parse(["--tiny", "--only", "flux,wan21", "--modes", "ours_cache"])
    assert args.only == ["flux", "wan21"] and args.modes == ["ours_cache"] and args.device.type == "cpu"
