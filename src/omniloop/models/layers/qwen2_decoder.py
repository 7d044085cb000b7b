"""The Qwen2 decoder layer, shared by every family that runs a Qwen2-class LM (the Qwen2 LM,
Qwen2.5-Omni's thinker and talker; Qwen3-Omni's thinker, talker and code predictor, whose
attention has no q/k/v biases and per-head q/k RMS norms (``DecoderDims.qkv_bias`` /
``qk_norm``) and whose MLP may be a mixture of experts (``DecoderLayer(mlp=...)``,
``omniloop.models.layers.moe``)).

One layer: RMSNorm -> GQA self-attention (q/k/v biases, rotate-half RoPE from the caller's
``cos, sin`` tables, keys/values through the forward's KV view) -> residual -> RMSNorm ->
SwiGLU MLP -> residual. Module names are transformers' (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``, ``o_proj``, ``down_proj``) so checkpoint keys map 1:1.

The q/k/v and gate/up projections come in two layouts (:attr:`DecoderDims.fused`):

* fused (the Qwen2 family): ONE ``qkv_proj`` Linear and ONE ``gate_up_proj`` Linear, fewer and
  larger matmuls per decode step (its loader concatenates the checkpoint's tensors; its
  tensor-parallel plan splits them by part);
* separate (Qwen2.5-Omni): transformers' ``q_proj``/``k_proj``/``v_proj`` and
  ``gate_proj``/``up_proj``, so the checkpoint loads by prefix stripping alone.

Each layout runs exactly the ops its family ran before (the parity tests are bit-equal to
transformers). Attention goes through ``omniloop.models.layers.attention`` (the deploy-time
backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderDims:
    """What one decoder layer is built from (each family derives it from its own config)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    fused: bool  # one qkv_proj / gate_up_proj Linear (True) or transformers' separate ones (False)
    qkv_bias: bool = True  # Qwen2's q/k/v biases (Qwen3's attention has none)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"{self.num_heads} query heads cannot share {self.num_kv_heads} kv heads evenly (the config validates this)"
        )

    def activation_bytes(self, dtype: torch.dtype, num_tokens: int, context: int, vocab_size: int) -> int:
        """Peak transient memory of one request's forward of ``num_tokens`` new tokens over
        ``context`` positions: a layer's live set (residual, norm, q|k|v, attention out,
        gate|up, SwiGLU product), fp32 attention scores (the math path materializes them),
        and one position's fp32 logits."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        layer = num_tokens * (3 * self.hidden_size + qkv + 3 * self.intermediate_size) * dtype.itemsize
        return int(layer + self.num_heads * num_tokens * context * 4 + vocab_size * 4)


class KVCacheView(Protocol):
    """What a forward needs from the KV cache (``omniloop.cache.kv.KVBatch``, ``omniloop.cache.paged_kv.PagedKVBatch``)."""

    positions: torch.Tensor  # [B, Lq] absolute positions of the new tokens
    # [B] each row's first new position (``positions[:, 0]``) as host ints, so a model that
    # addresses per-request inputs by position reads them without a device sync; None where the
    # positions live on the device only (a CUDA-graph decode step)
    starts: Sequence[int] | None
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] bool (True = attend), or None: plain bottom-right causal

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[B, Lq, H_kv, D]`` new keys/values of ``layer``; return all ``[B, Lk, H_kv, D]``."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the model dtype (transformers' order).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 angles ``freqs [B, L, D/2]`` -> ``cos, sin [B, L, 1, D]`` in ``dtype`` (rotate-half layout)."""
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, L, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [B, L, H, D]`` with ``cos, sin [B, L, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention; ``num_heads`` / ``num_kv_heads`` are what tensor parallelism divides."""

    qkv_proj: nn.Linear | None
    q_proj: nn.Linear | None
    k_proj: nn.Linear | None
    v_proj: nn.Linear | None

    def __init__(self, dims: DecoderDims, layer: int) -> None:
        super().__init__()
        self.layer = layer  # index into the KV view (structure, not request state)
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        q_dim, kv_dim = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        if dims.fused:
            self.qkv_proj = nn.Linear(dims.hidden_size, q_dim + 2 * kv_dim, bias=dims.qkv_bias)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.qkv_proj = None
            self.q_proj = nn.Linear(dims.hidden_size, q_dim, bias=dims.qkv_bias)
            self.k_proj = nn.Linear(dims.hidden_size, kv_dim, bias=dims.qkv_bias)
            self.v_proj = nn.Linear(dims.hidden_size, kv_dim, bias=dims.qkv_bias)
        self.o_proj = nn.Linear(q_dim, dims.hidden_size, bias=False)
        # Qwen3's per-head norms (module names transformers'); None for Qwen2
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps) if dims.qk_norm else None
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps) if dims.qk_norm else None
        self.attention_backend = DEFAULT_BACKEND  # set from outside by set_attention_backend

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, hidden]`` -> flat ``q [B, L, H*D]``, ``k, v [B, L, H_kv*D]``."""
        if self.qkv_proj is not None:
            q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((q_dim, kv_dim, kv_dim), dim=-1)
            return q, k, v
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCacheView | None) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self._project(x)
        q = q.view(b, length, self.num_heads, self.head_dim)  # [B, Lq, H, D]
        k = k.view(b, length, self.num_kv_heads, self.head_dim)  # [B, Lq, H_kv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(b, length, self.num_kv_heads, self.head_dim)
        mask = None
        if kv is not None:
            k, v = kv.update(self.layer, k, v)  # [B, Lk, H_kv, D]
            mask = kv.mask
        out = attention(q, k, v, self.attention_backend, mask=mask, causal=mask is None)
        return self.o_proj(out.reshape(b, length, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``intermediate_size`` is what tensor parallelism divides."""

    gate_up_proj: nn.Linear | None
    gate_proj: nn.Linear | None
    up_proj: nn.Linear | None

    def __init__(self, dims: DecoderDims) -> None:
        super().__init__()
        self.intermediate_size = dims.intermediate_size
        if dims.fused:
            self.gate_up_proj = nn.Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=False)
            self.gate_proj = self.up_proj = None
        else:
            self.gate_up_proj = None
            self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
            self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        assert self.gate_proj is not None and self.up_proj is not None
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """``mlp``: the layer's feed-forward when it is not the SwiGLU of ``dims`` (a mixture of
    experts, ``omniloop.models.layers.moe.SparseMoE``)."""

    def __init__(self, dims: DecoderDims, layer: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = Attention(dims, layer)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = MLP(dims) if mlp is None else mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCacheView | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))
