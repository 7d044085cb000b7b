"""A sparse mixture-of-experts feed-forward (Qwen3-MoE / Qwen3-Omni's thinker and talker).

Each token's router logits ``gate(x) [N, E]`` -> softmax in fp32 -> its ``top_k`` experts (their
probabilities renormalized to sum to 1 when ``norm_topk_prob``); the output is the weighted sum
of those experts' SwiGLU MLPs, plus (the talker's) a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Module names are the checkpoint's
(``mlp.gate.weight``, ``mlp.experts.<e>.gate_proj.weight``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate.weight``), so it loads by name.

The experts run one after another over the tokens routed to them (transformers' eager order:
expert by expert, each token's contributions summed with ``index_add_``); a decode batch of B
tokens touches at most ``B * top_k`` experts.

Under :func:`static_dispatch` (a captured CUDA-graph decode step, ``pipeline/loops/ar_graphs.py``)
the sparse loop cannot run: which experts are hit is a host read (a sync, forbidden while
capturing) and each expert's token count is data-dependent. There every expert runs over every
token and an unrouted token's output is dropped (``torch.where`` on its routing weight: fixed
shapes, no host read); the same experts in the same (ascending) order add up, so the output
equals the sparse loop's up to the matmuls' batching (tests/layers: within 1e-6 in fp32). It
costs ``num_experts`` expert MLPs a layer instead of the hit ones: the graph removes the
launches, the extra expert reads remain (measured per family in bench_ar_step.py --cuda-graphs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from omniloop.models.layers.qwen2_decoder import MLP, DecoderDims


# the calling context's dispatch (a per-call mode, never per-request state): True inside a
# CUDA-graph decode step, whose forward is captured once and replayed with any routing
_STATIC_DISPATCH: ContextVar[bool] = ContextVar("moe_static_dispatch", default=False)


@contextmanager
def static_dispatch() -> Iterator[None]:
    """Inside it, every MoE layer runs every expert over every token (fixed shapes, no host read)."""
    token = _STATIC_DISPATCH.set(True)
    try:
        yield
    finally:
        _STATIC_DISPATCH.reset(token)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEDims:
    hidden_size: int
    expert_intermediate_size: int  # each expert's (``moe_intermediate_size``)
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0  # 0: no shared expert (the thinker); the talker's has one

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")

    def mlp_dims(self, intermediate: int) -> DecoderDims:
        return DecoderDims(hidden_size=self.hidden_size, intermediate_size=intermediate, num_heads=1, num_kv_heads=1,
                           head_dim=1, rms_norm_eps=0.0, fused=False)


class SparseMoE(nn.Module):
    def __init__(self, dims: MoEDims) -> None:
        super().__init__()
        self.dims = dims
        self.gate = nn.Linear(dims.hidden_size, dims.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(dims.mlp_dims(dims.expert_intermediate_size)) for _ in range(dims.num_experts))
        if dims.shared_intermediate_size:
            self.shared_expert: MLP | None = MLP(dims.mlp_dims(dims.shared_intermediate_size))
            self.shared_expert_gate: nn.Linear | None = nn.Linear(dims.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, hidden]`` -> each token's expert weights ``[N, k]`` (x's dtype) and ids ``[N, k]``."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, experts = torch.topk(probs, self.dims.top_k, dim=-1)
        if self.dims.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        weights, experts = self.route(flat)
        out = self._dense(flat, weights, experts) if _STATIC_DISPATCH.get() else self._sparse(flat, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)

    def _sparse(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The hit experts over their tokens: ``flat [N, hidden]``, ``weights, experts [N, k]``."""
        out = torch.zeros_like(flat)
        # one host read of which experts are hit (the loop below is over those only)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)  # the tokens routed to expert e, and at which of their k slots
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _dense(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, unrouted outputs dropped (capturable: see the module docstring)."""
        n, e_count = flat.shape[0], self.dims.num_experts
        dense = torch.zeros(n, e_count, dtype=weights.dtype, device=flat.device).scatter_(1, experts, weights)  # [N, E]
        routed = torch.zeros(n, e_count, dtype=torch.bool, device=flat.device).scatter_(1, experts, True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            y = expert(flat) * dense[:, e, None]
            out = out + torch.where(routed[:, e, None], y.to(out.dtype), 0)  # where: an unrouted inf/nan is not added
        return out
