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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omniloop.models.layers.qwen2_decoder import MLP, DecoderDims


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
        out = torch.zeros_like(flat)
        # one host read of which experts are hit (the loop below is over those only)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)  # the tokens routed to expert e, and at which of their k slots
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)
