"""The ``cudnn_fp8`` attention backend: its operand preparation (centering, power-of-two
scales) on the CPU, emulated end to end in fp32 against exact attention; the cuDNN call
itself on a GPU (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.layers.attention import attention
from omniloop.models.layers.attention_cudnn_fp8 import E4M3, P_SCALE, pow2_scale, prepare


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
    """What the cuDNN graph computes on ``prepare``'s operands, in fp32 torch ops."""
    ops = prepare(q, k, v)
    qd, kd, vd = (t.float() / s.reshape(()) for t, s in ((ops.q, ops.q_scale), (ops.k, ops.k_scale), (ops.v, ops.v_scale)))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * q.shape[-1] ** -0.5
    p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    p8 = (p * P_SCALE).to(E4M3).float() / P_SCALE
    o = torch.einsum("bhqk,bkhd->bqhd", p8 / l, vd)
    o8 = (o * ops.o_scale.reshape(())).clamp(-448, 448).to(E4M3).float() / ops.o_scale.reshape(())
    return o8 + ops.v_mean.float()


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


def test_deploy_config_checks_the_device_and_the_package(monkeypatch):
    import importlib.util

    from pydantic import ValidationError

    from omniloop.deploy import DeployConfig

    with pytest.raises(ValidationError, match="needs a CUDA GPU"):
        DeployConfig(device="cpu", attention_backend="cudnn_fp8")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValidationError, match="pip install nvidia-cudnn-frontend"):
        DeployConfig(device="cuda", attention_backend="cudnn_fp8")
