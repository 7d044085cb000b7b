"""The ``triton_8bit`` attention backend: its Triton kernel in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, in a subprocess so no other test sees the flag) against fp32
attention, and its refusals in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from omniloop.models.layers.attention import attention

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import json, torch
    from omniloop.models.layers.attention import attention

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    torch.manual_seed(0)
    out = {}
    # (batch, Lq, Lk, heads, head_dim): ragged lengths, cross-attention (Lk != Lq), both head dims
    for b, lq, lk, h, d in [(1, 200, 200, 2, 64), (2, 130, 77, 1, 128), (1, 64, 300, 3, 128)]:
        q = torch.randn(b, lq, h, d).bfloat16()
        k = (torch.randn(b, lk, h, d) + 2.0).bfloat16()  # a shared offset: what K smoothing removes
        v = torch.randn(b, lk, h, d).bfloat16()
        got = attention(q, k, v, backend="triton_8bit")
        ref = attention(q.float(), k.float(), v.float(), backend="math")
        out[f"{b}x{lq}x{lk}x{h}x{d}"] = {"rel": rel(got, ref), "bf16_rel": rel(attention(q, k, v, backend="math"), ref),
                                          "shape_ok": got.shape == q.shape and got.dtype == q.dtype}
    # the other tiles the GPU autotuner may pick (scales stay per 128 queries / 64 keys)
    import omniloop.models.layers.attention_8bit as a8
    q = torch.randn(1, 200, 2, 128).bfloat16()
    k = (torch.randn(1, 333, 2, 128) + 2.0).bfloat16()
    v = torch.randn(1, 333, 2, 128).bfloat16()
    ref = attention(q.float(), k.float(), v.float(), backend="math")
    for bm, bn in ((64, 128), (128, 32), (64, 64)):
        a8.INTERPRETER_TILE = {"BLOCK_M": bm, "BLOCK_N": bn}
        out[f"tile{bm}x{bn}"] = {"rel": rel(attention(q, k, v, backend="triton_8bit"), ref), "bf16_rel": 0.0,
                                 "shape_ok": True}
    # peaky attention (each query matches one key): the output is that key's value
    k = torch.nn.functional.normalize(torch.randn(1, 96, 2, 64), dim=-1) * 8
    v = torch.randn(1, 96, 2, 64)
    got = attention((k * 8).bfloat16(), k.bfloat16(), v.bfloat16(), backend="triton_8bit")
    out["peaky"] = {"rel": rel(got, v)}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fp8_kernel_tracks_fp32_attention(interpreted):
    # random Gaussian q/k/v is the hard case (flat softmax, heavily cancelling output); the
    # interpreter also rounds to e4m3 toward zero where GPUs round to nearest
    for case, r in interpreted.items():
        if case == "peaky":
            continue
        assert r["shape_ok"], case
        assert r["rel"] < 0.09, (case, r)
        assert r["rel"] > r["bf16_rel"], (case, r)  # really ran in FP8


def test_fp8_kernel_picks_the_matching_key(interpreted):
    assert interpreted["peaky"]["rel"] < 0.06


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"causal": True}, "non-causal"), ({"mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, "unmasked")],
)
def test_masks_and_causal_are_refused(kwargs, match):
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match=match):
        attention(q, q, q, backend="triton_8bit", **kwargs)


def test_cpu_without_the_interpreter_and_gqa_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 4, 2, 64)
    with pytest.raises(ValueError, match="attention_backend='sdpa'"):
        attention(q, q, q, backend="triton_8bit")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="equal query/key heads"):
        attention(q, q[:, :, :1], q[:, :, :1], backend="triton_8bit")
