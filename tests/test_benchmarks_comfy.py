"""benchmarks/bench_comfy.py --tiny (CPU smoke): the ComfyUI templates go through a real server's
ComfyUI API in both modes, every prompt saves its file, and the burst's steps were batched
where one at a time never batched (CPU timings of the toy are not compared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")


@pytest.mark.slow
def test_comfy_benchmark_smoke(tmp_path):
    out, scratch = tmp_path / "comfy.jsonl", tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_comfy.py"), "--tiny", "--prompts", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["family"], r["mode"]): r for r in records}
    assert set(by) == {(f, m) for f in ("flux", "wan") for m in ("setup", "one_at_a_time", "burst", "ratios")}
    for family, media in (("flux", "images"), ("wan", "videos")):
        alone, burst = by[(family, "one_at_a_time")], by[(family, "burst")]
        for record in (alone, burst):
            assert record["prompts"] == record["files"] == 4  # one image / one mp4 each, served by /view
            assert record[f"{media}_per_s"] > 0 and 0 < record["latency_p50_s"] <= record["latency_p95_s"]
        assert alone["batched_steps"] == 0 and alone["mean_batch"] == 1
        assert burst["batched_steps"] > 0 and burst["mean_batch"] > 1
        assert by[(family, "ratios")]["throughput_burst_vs_one_at_a_time"] > 0
    assert by[("flux", "burst")]["shapes"] == ["32x32", "48x48", "64x64"]
    assert by[("wan", "burst")]["saved_as"] == "mp4"
    assert not list(scratch.glob("bench_comfy_*"))  # the random checkpoints and folders are deleted
