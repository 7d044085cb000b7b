"""The Cosmos3 benchmark's CPU mode runs and reports every figure (the GPU mode is the same
code at the published architecture)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cosmos3_benchmark_smoke(tmp_path):
    out = tmp_path / "cosmos3.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cosmos3.py"), "--tiny", "--out", str(out),
                           "--long-prompt-words", "300"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["bench"] for r in records} == {"reasoner_decode", "reasoner_decode_step", "reasoner_decode_gap",
                                             "reasoner_decode_profile", "reasoner_with_denoise", "mixed_trace",
                                             "resident"}
    profile = [r for r in records if r["bench"] == "reasoner_decode_profile"]
    assert {r["batch"] for r in profile} == {1, 4}
    # the engine's own functions are among the profiled host time (and so named)
    assert all(r["top_own_ms_per_step"] and all(t["own_ms"] >= 0 and t["calls"] > 0 for t in r["top_own_ms_per_step"])
               for r in profile), profile
    step = {r["batch"]: r for r in records if r["bench"] == "reasoner_decode_step"}
    assert set(step) == {1, 4} and all(r["ms_per_step"] > r["forward_ms"] > 0 for r in step.values())
    # the per-step indices, mask and greedy sampling are whole-batch ops: 3 more rows add a
    # few ops, not a copy of the per-row work (was ~22 ops a row: slot building, argmax + item)
    assert step[4]["ops_per_step"] <= step[1]["ops_per_step"] + 10, step
    assert all(r["host_syncs_per_step"] == 0 for r in step.values()), step  # no scalar read on the step's path
    gap = {(r["batch"], r["run"]): r for r in records if r["bench"] == "reasoner_decode_gap"}
    assert set(gap) == {(b, run) for b in (1, 4) for run in ("first", "again")}, gap
    # every decode step of the 12-token requests is timed; the model's share is inside the engine's step
    assert all(r["decode_steps"] == 12 and r["engine_ms_mean"] > r["model_ms_mean"] > 0 for r in gap.values()), gap
    decode = {(r["batch"], r["prompt_tokens"]): r for r in records if r["bench"] == "reasoner_decode"}
    # batches 1 and 4 at the default prompt, and batch 1 at --long-prompt-words' longer one
    assert sorted(b for b, _ in decode) == [1, 1, 4], decode
    short, long_ = sorted(t for b, t in decode if b == 1)
    assert long_ > 2 * short, decode
    decode = {b: r for (b, t), r in decode.items() if t == short or b == 4}
    # re-prefilling the ~280-token context per generated token is slower than one paged decode step
    assert decode[4]["paged_tokens_per_s"] > decode[4]["reprefill_tokens_per_s"]
    concurrent = next(r for r in records if r["bench"] == "reasoner_with_denoise")
    assert concurrent["denoise_request_steps"] == 2 * 3 and concurrent["reasoner_with_video_tokens_per_s"] > 0
    mixed = {r.get("policy"): r for r in records if r["bench"] == "mixed_trace"}
    assert {"fifo", "step_scheduler"} <= set(mixed) and mixed[None]["metric"] == "p95_chat_fifo_over_step_scheduler"
    resident = next(r for r in records if r["bench"] == "resident")
    assert resident["reasoner_shares_weights"] and resident["param_bytes"] == 4 * resident["params"]
