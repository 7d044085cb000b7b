"""benchmarks/bench_ti2v_modulation_memory.py (CPU smoke, in process): its bf16 path -- the one
the 5B GPU run takes, which once failed with "mat1 and mat2 must have the same dtype" because the
bench cast the whole DiT, time embedder included, to bf16 -- runs at a small size, builds the DiT
with the loader's fp32 islands, and gives bit-equal outputs per token and per frame."""

from __future__ import annotations

import torch

from tests.bench_modules import bench_module


def _bench():
    return bench_module("bench_ti2v_modulation_memory")


def test_bf16_modes_run_and_agree_bit_for_bit(tmp_path):
    bench = _bench()
    dit = bench._build_dit(bench.TINY, "cpu", torch.bfloat16)
    assert dit.time_embedder.linear_1.weight.dtype == dit.scale_shift_table.dtype == torch.float32
    assert dit.proj_out.weight.dtype == dit.blocks[0].ffn.proj_in.weight.dtype == torch.bfloat16
    records, outputs = {}, {}
    for mode in ("per_token", "per_frame"):
        out = tmp_path / f"{mode}.pt"
        records[mode] = bench._one_mode(mode, False, torch.bfloat16, 64, 64, 9, 2, str(out))
        outputs[mode] = torch.load(out)
    assert records["per_token"]["timestep_rows"] == records["per_token"]["tokens"] == 12
    assert records["per_frame"]["timestep_rows"] == 3 and records["per_frame"]["dtype"] == "torch.bfloat16"
    assert outputs["per_frame"].dtype == torch.bfloat16 and outputs["per_frame"].shape == (2, 48, 3, 4, 4)
    assert torch.equal(outputs["per_token"], outputs["per_frame"])


def test_a_failed_child_shows_the_head_and_tail_of_its_stderr():
    bench = _bench()
    text = "Traceback (most recent call last):\n" + "x" * 50_000 + "\nRuntimeError: the error"
    shown = bench._head_and_tail(text, keep=100)
    assert shown.startswith("Traceback") and shown.endswith("RuntimeError: the error")
    assert "[49859 characters cut]" in shown and len(shown) < 300
    assert bench._head_and_tail("short") == "short"
