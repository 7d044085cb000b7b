"""The ``cudnn_fp8`` attention backend: its operand preparation (centering, power-of-two
scales) on the CPU, emulated end to end in fp32 against exact attention; the cuDNN call
itself on a GPU (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.layers.attention import attention
from omniloop.models.layers.attention_cudnn_fp8 import E4M3, fp8_attention, pow2_scale, prepare, sdpa_fp8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(seed: int = 0, lq: int = 256, lk: int = 256, peaky: bool = False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, lk, 3, 64, generator=g) + 1.5  # an offset in K and V: what centering removes
    v = torch.randn(2, lk, 3, 64, generator=g) + 0.5
    q = torch.randn(2, lq, 3, 64, generator=g)
    if peaky:
        k = torch.nn.functional.normalize(k, dim=-1) * 8
        q = k[:, :lq] * 8
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _emulate(q, k, v) -> torch.Tensor:
    """What the cuDNN graph computes on ``prepare``'s operands: the op's CPU kernel (fp32 torch ops)."""
    return fp8_attention(q, k, v).float()


def test_scales_are_powers_of_two_that_fit_e4m3():
    x = torch.randn(4, 100) * 37.0
    s = pow2_scale(x)
    assert s.shape == (1, 1, 1, 1) and torch.log2(s).frac().item() == 0.0
    assert 224.0 < (x.abs().max() * s).item() <= 448.0
    assert (x.abs().max() * pow2_scale(x, 0.5)).item() <= 224.0


def test_centering_keeps_attention_and_quantization_stays_close():
    q, k, v = _inputs()
    ops = prepare(q, k, v)
    assert ops.q.dtype == ops.k.dtype == ops.v.dtype == E4M3 and ops.q.shape == q.shape
    exact = attention(q.float(), k.float(), v.float(), backend="math")
    # the centered operands, dequantized, give the same attention up to e4m3 rounding
    centered_k = k.float() - k.float().mean(dim=1, keepdim=True)
    assert _rel(attention(q.float(), centered_k, v.float(), backend="math"), exact) < 1e-5
    assert _rel(_emulate(q, k, v), exact) < 0.1


def test_peaky_attention_returns_the_matching_value():
    q, k, v = _inputs(peaky=True)
    assert _rel(_emulate(q, k, v), v.float()) < 0.05


def test_compiled_blocks_trace_through_the_fp8_attention_without_a_graph_break():
    """Only the cuDNN call is opaque (a custom op): the preparation before it and the
    dequantization after it are traced, so inductor fuses them into the block."""
    q, k, v = _inputs(lq=32, lk=32)
    eager = fp8_attention(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_attention, backend="aot_eager", fullgraph=True)  # fullgraph: a break is an error
    assert torch.equal(compiled(q, k, v), eager)
    explained = torch._dynamo.explain(fp8_attention)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_inductor_compiled_attention_keeps_the_kernels_output_layout():
    """Inductor picks its own layout for the e4m3 operands it writes; the op's fake kernel
    must still describe the row-major O both kernels return (it copied q8's strides once:
    a wrong read of O, caught by Inductor's stride assert). Same error as eager."""
    q, k, v = _inputs(lq=64, lk=64)
    exact = attention(q.float(), k.float(), v.float(), backend="math")
    torch._dynamo.reset()
    compiled = torch.compile(fp8_attention, fullgraph=True)(q, k, v)
    assert compiled.shape == q.shape and compiled.dtype == q.dtype
    assert _rel(compiled, exact) < 0.1 and _rel(compiled, fp8_attention(q, k, v)) < 0.1


def test_refusals_name_the_backend_to_use():
    q, k, v = _inputs(lq=8, lk=8)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        attention(q, k, v, backend="cudnn_fp8")
    with pytest.raises(ValueError, match="non-causal"):
        attention(q, k, v, backend="cudnn_fp8", causal=True)


@pytest.mark.gpu
def test_cudnn_kernel_matches_the_emulation_on_a_gpu():
    pytest.importorskip("cudnn")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    q, k, v = (t.cuda() for t in _inputs(lq=1000, lk=700))
    out = attention(q, k, v, backend="cudnn_fp8")
    assert out.shape == q.shape and out.dtype == q.dtype
    exact = attention(q.float(), k.float(), v.float(), backend="math")
    assert _rel(out, exact) < 0.1
    # the kernel does what its CPU reference does, on the same e4m3 operands
    ops = prepare(q, k, v)
    args = (ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale, ops.v_scale, ops.o_scale)
    gpu = sdpa_fp8(*args).float() / ops.o_scale.reshape(())
    cpu = sdpa_fp8(*(a.cpu() for a in args)).float() / ops.o_scale.cpu().reshape(())
    assert _rel(gpu.cpu(), cpu) < 0.05
    compiled = torch.compile(lambda a, b, c: attention(a, b, c, backend="cudnn_fp8"), fullgraph=True)
    assert _rel(compiled(q, k, v), exact) < 0.1


def test_deploy_config_checks_the_device_and_the_package(monkeypatch):
    import importlib.util

    from pydantic import ValidationError

    from omniloop.deploy import DeployConfig

    with pytest.raises(ValidationError, match="needs a CUDA GPU"):
        DeployConfig(device="cpu", attention_backend="cudnn_fp8")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValidationError, match="pip install nvidia-cudnn-frontend"):
        DeployConfig(device="cuda", attention_backend="cudnn_fp8")
