"""Multi-pathway (mixture-of-transformers) layers: per-pathway weights, shared attention.

A MoT layer holds one :class:`Pathway` per token stream (Cosmos3: ``und`` for text, the
causal understanding pathway; ``gen`` for vision/sound/action, the generation pathway).
Each pathway has its own input norm, Q/K/V/O projections with per-head Q/K norms, post
norm and MLP; the attention is shared: every query attends over the keys of whatever
pathways its :class:`~omniloop.models.layers.packed_seq.PackedSeq` mode lets it see.

Two ways to run a layer, one set of weights:

* :meth:`MoTLayer.forward_packed` -- the joint forward over one packed sequence of any
  number of samples (tokens routed to their pathway by segment, attention through
  ``packed_attention``), what a training step or a token-budget packed batch runs;
* :meth:`MoTLayer.forward_pathway` -- one pathway's tokens ``[B, L, D]`` with their keys
  and values appended to / read from a KV view: the AR reasoner's prefill and decode
  (``und``, causal over a per-request KV), and a denoise step's generation tokens (``gen``)
  attending a cached text context plus themselves. Because the understanding stream never
  attends generation tokens, the two give the joint forward's numbers.

Departures from the checkpoint layout (numerically equivalent; the family's ``weights.py``
maps names): Q/K/V are one fused ``qkv`` Linear and gate/up one ``gate_up`` Linear (fewer,
larger GEMMs; a fused GEMM's column blocks equal the separate GEMMs bit for bit on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.mrope import Rotary
from omniloop.models.layers.packed_seq import PackedSeq, packed_attention


@dataclass(frozen=True, kw_only=True)
class PathwayConfig:
    hidden_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    eps: float = 1e-6
    bias: bool = False  # attention projections
    act: Literal["silu", "relu2"] = "silu"  # SwiGLU MLP, or Nemotron's squared-ReLU MLP
    qk_norm: bool = True  # per-head RMS norms on Q and K
    fp32_norm_weight: bool = False  # Nemotron norms scale in fp32 before the cast back

    def __post_init__(self) -> None:
        for name in ("hidden_size", "head_dim", "num_heads", "num_kv_heads", "intermediate_size"):
            assert getattr(self, name) >= 1, f"PathwayConfig.{name} must be >= 1, got {getattr(self, name)}"
        assert self.num_heads % self.num_kv_heads == 0, (
            f"{self.num_heads} query heads cannot share {self.num_kv_heads} kv heads evenly"
        )
        assert self.act in ("silu", "relu2"), f"unknown pathway activation {self.act!r}"


class KVView(Protocol):
    """What a pathway forward needs from a KV cache (``omniloop.cache``: paged or contiguous)."""

    mask: torch.Tensor | None  # [B, 1, Lq, Lk] bool (True = attend) or None
    causal: bool  # with mask None: bottom-right causal over what update() returns

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take ``[B, Lq, H_kv, D]`` new keys/values of ``layer``; return every key/value ``[B, Lk, H_kv, D]``."""
        ...


class RMSNorm(nn.Module):
    """Normalize in fp32, then scale: ``weight * x.to(dtype)`` (Qwen3 / Cosmos3), or with
    ``fp32_weight`` ``(weight.float() * x).to(dtype)`` (Nemotron)."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp32_weight = fp32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm normalizes in fp32 and casts back to x's dtype: one fused kernel on CUDA;
        # on the CPU the same pow/mean/rsqrt ops, bit-equal to the written-out
        # ``(xf * rsqrt(xf.pow(2).mean(-1) + eps)).to(dtype)`` (fewer ops per norm per token)
        if self.fp32_weight:
            return (self.weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)).to(x.dtype)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class PathwayMLP(nn.Module):
    def __init__(self, config: PathwayConfig) -> None:
        super().__init__()
        self.act = config.act
        self.intermediate_size = config.intermediate_size
        width = 2 * config.intermediate_size if config.act == "silu" else config.intermediate_size
        self.gate_up = nn.Linear(config.hidden_size, width, bias=False)  # [gate; up] for SwiGLU, up for relu2
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "relu2":
            return self.down(torch.relu(self.gate_up(x)).square())
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up)


class Pathway(nn.Module):
    """One expert's weights in a MoT layer."""

    def __init__(self, config: PathwayConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q_dim, self.kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = RMSNorm(c.hidden_size, c.eps, c.fp32_norm_weight)
        self.qkv = nn.Linear(c.hidden_size, self.q_dim + 2 * self.kv_dim, bias=c.bias)
        self.q_norm = RMSNorm(c.head_dim, c.eps, c.fp32_norm_weight) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.eps, c.fp32_norm_weight) if c.qk_norm else None
        self.o_proj = nn.Linear(self.q_dim, c.hidden_size, bias=c.bias)
        self.post_norm = RMSNorm(c.hidden_size, c.eps, c.fp32_norm_weight)
        self.mlp = PathwayMLP(c)

    def project(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, ...]:
        """Normed ``x [..., L, D]`` -> ``q [..., L, H, Dh]``, ``k, v [..., L, H_kv, Dh]`` (Q/K normed and rotated)."""
        c = self.config
        q, k, v = self.qkv(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        return rope.apply(q), rope.apply(k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention ``attn [..., L, H, Dh]``: O projection, then the MLP block."""
        x = x + self.o_proj(attn.flatten(-2))
        return x + self.mlp(self.post_norm(x))


class MoTLayer(nn.Module):
    def __init__(self, pathways: Mapping[str, PathwayConfig], layer: int) -> None:
        super().__init__()
        self.layer = layer  # index into a KV view (structure, not request state)
        self.pathways = nn.ModuleDict({name: Pathway(c) for name, c in pathways.items()})
        self.attention_backend = DEFAULT_BACKEND  # set from outside by set_attention_backend

    def pathway(self, name: str) -> Pathway:
        """The expert ``name`` (``nn.ModuleDict`` holds it as a plain ``Module``)."""
        p = self.pathways[name]
        assert isinstance(p, Pathway), f"pathway {name!r} is a {type(p).__name__}"
        return p

    def forward_pathway(
        self, name: str, x: torch.Tensor, rope: Rotary, kv: KVView | None = None, *, causal: bool = True,
    ) -> torch.Tensor:
        """``x [B, L, D]`` tokens of pathway ``name`` -> ``[B, L, D]`` (``rope``: the forward's
        tables, built once for every layer: ``Rotary.of(cos, sin)``). With ``kv`` the new
        keys/values go through ``kv.update`` and attention spans what it returns (its mask
        or causal flag); without, the tokens attend each other (``causal`` or full)."""
        p = self.pathway(name)
        q, k, v = p.project(p.input_norm(x), rope)
        mask = None
        if kv is not None:
            k, v = kv.update(self.layer, k, v)
            mask, causal = kv.mask, kv.causal and kv.mask is None
        return p.finish(x, attention(q, k, v, self.attention_backend, mask=mask, causal=causal))

    def forward_packed(self, x: torch.Tensor, seq: PackedSeq, rope: Rotary) -> torch.Tensor:
        """``x [N, D]`` every token of ``seq`` -> ``[N, D]``; ``rope``: ``Rotary.of(cos, sin)`` of ``cos, sin [N, Dh]``."""
        qs, ks, vs, rows = [], [], [], []
        for name, p in self.pathways.items():
            idx = seq.index(x.device, pathway=name)
            if idx.numel() == 0:
                continue
            q, k, v = p.project(p.input_norm(x[idx]), rope.select(idx))
            qs.append(q)
            ks.append(k)
            vs.append(v)
            rows.append(idx)
        order = torch.cat(rows)
        q, k, v = (torch.empty((x.shape[0], *t[0].shape[1:]), dtype=t[0].dtype, device=x.device).index_copy_(
            0, order, torch.cat(t)) for t in (qs, ks, vs))
        attn = packed_attention(q, k, v, seq, self.attention_backend)  # [N, H, Dh]
        out = torch.empty_like(x)
        for name, idx in zip([n for n in self.pathways if seq.index(pathway=n).numel()], rows):
            out[idx] = self.pathway(name).finish(x[idx], attn[idx])
        return out
