"""benchmarks/bench_rl_rollout.py stays runnable and fair: its tiny mode on the tiny Wan checkpoint
rolls out 2 groups of 2 through the engine (batched) and through the private sequential loop, and
the two agree (the engine alone, at the private loop's shapes, bit for bit)."""

from __future__ import annotations

import json

from tests.bench_modules import bench_module


def _bench():
    return bench_module("bench_rl_rollout")


def test_tiny_rollout_bench_engine_and_private_loop_agree(wan_t2v_dir, tmp_path):
    out = tmp_path / "rl.jsonl"
    _bench().main(["--tiny", "--model", str(wan_t2v_dir), "--threads", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    paths = {r["path"]: r for r in records if "path" in r}
    engine, private = paths["engine"], paths["private"]
    assert engine["requests"] == private["requests"] == 4 and engine["rollouts_per_s"] > 0 < private["rollouts_per_s"]
    assert engine["denoise_step_calls_by_batch"] == {"2": 4}  # 2 groups x 2 steps, each group one batch of 2
    agree = next(r for r in records if r.get("metric") == "agreement")
    assert agree["ok"] and agree["solo_engine_bit_equal"], agree
    assert agree["latents_rel_diff"] <= 1e-5 and agree["log_probs_max_abs_diff"] <= 1e-3
    assert agree["video_max_abs_diff_uint8"] <= 1
    scaling = next(r for r in records if r.get("metric") == "forward_scaling")
    assert scaling["batch"] == 2 and scaling["per_row_gain"] > 0
    ratio = next(r for r in records if r.get("metric") == "ratio")
    assert ratio["engine_over_private"] > 0 and ratio["decode"] and ratio["log_probs"]
