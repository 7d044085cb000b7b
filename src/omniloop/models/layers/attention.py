"""Attention backend registry.

Every attention call in model code goes through :func:`attention`, so the kernel is a
deploy-time choice (``DeployConfig.attention_backend``) and never a model edit. A backend
takes ``q, k, v`` laid out ``[B, L, H, D]`` (the layout DiTs produce after their head
split) and returns ``[B, Lq, H, D]``.

The backend is chosen per module tree by :func:`set_attention_backend`, which writes the
name onto the attention-owning modules: it is deployment state shared by every request,
never per-request state.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class AttentionFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


_BACKENDS: dict[str, AttentionFn] = {}
DEFAULT_BACKEND = "sdpa"


def register_attention_backend(name: str) -> Callable[[AttentionFn], AttentionFn]:
    def wrap(fn: AttentionFn) -> AttentionFn:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered")
        _BACKENDS[name] = fn
        return fn

    return wrap


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionFn:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; pass one of {available_attention_backends()}"
        ) from None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = DEFAULT_BACKEND) -> torch.Tensor:
    """``[B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D]`` with the named backend."""
    return _BACKENDS[backend](q, k, v)


@register_attention_backend("sdpa")
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # SDPA wants [B, H, L, D]; torch picks the kernel (flash / mem-efficient / math).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


@register_attention_backend("sdpa_cudnn")
def _sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # cuDNN's fused attention is the fastest SDPA kernel on Hopper for head_dim 128;
    # fall back to the default dispatch where it is unavailable (CPU, old GPUs).
    if not q.is_cuda:
        return _sdpa(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return _sdpa(q, k, v)


@register_attention_backend("sdpa_flash")
def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if not q.is_cuda:
        return _sdpa(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return _sdpa(q, k, v)


@register_attention_backend("math")
def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference attention in plain ops (float32 accumulate); for parity debugging."""
    scale = q.shape[-1] ** -0.5
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    weights = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, dim=-1)
    return (weights @ vf).transpose(1, 2).to(q.dtype)


def set_attention_backend(module: torch.nn.Module, name: str) -> None:
    """Select ``name`` for every attention-owning submodule (those with ``attention_backend``)."""
    get_attention_backend(name)  # validate before mutating anything
    for sub in module.modules():
        if hasattr(sub, "attention_backend"):
            sub.attention_backend = name
