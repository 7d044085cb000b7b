"""Tensor parallelism applied from outside by a family's :class:`TensorPlan` (torchtitan's
``parallelize_module`` idea, with raw process groups instead of DTensor on the hot path).

Each matching ``nn.Linear`` / ``nn.RMSNorm`` is replaced by a module holding this rank's
shard of the loaded weights; the attention modules' ``heads`` become heads / tp. Hidden
states between the sharded pairs stay replicated, so everything outside them (adaLN,
LayerNorms, embedders, the head) runs unchanged on every rank.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omniloop.parallel.plan import Colwise, HeadNorm, Rowwise, ShardStyle, TensorPlan


def _shard(t: torch.Tensor, dim: int, rank: int, size: int, chunks: int | tuple[int, ...] = 1) -> torch.Tensor:
    """This rank's slice of every part of ``t`` along ``dim``, concatenated: ``chunks`` equal
    parts, or parts of the given relative widths."""
    if isinstance(chunks, tuple):
        unit, rest = divmod(t.shape[dim], sum(chunks))
        assert rest == 0, f"dim {dim} of {tuple(t.shape)} does not split into parts {chunks}"
        parts = t.split([unit * c for c in chunks], dim=dim)
    else:
        parts = t.chunk(chunks, dim=dim)
    assert all(p.shape[dim] % size == 0 for p in parts), f"dim {dim} of {tuple(t.shape)} does not split {chunks}x{size}"
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in parts], dim=dim).contiguous()


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local^T + b_local``: this rank's output features (of each fused part)."""

    def __init__(self, linear: nn.Linear, rank: int, size: int, chunks: int | tuple[int, ...] = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(_shard(linear.weight.data, 0, rank, size, chunks), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(_shard(bias.data, 0, rank, size, chunks), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: input features sharded, output replicated."""

    def __init__(self, linear: nn.Linear, rank: int, size: int, group: Any, parts: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_shard(linear.weight.data, 1, rank, size, parts), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class HeadShardedRMSNorm(nn.Module):
    """``nn.RMSNorm`` over all ``dim`` features, applied to this rank's feature shard: the
    sum of squares is all-reduced (one [.., 1] tensor), the weight is sharded."""

    def __init__(self, norm: nn.RMSNorm, rank: int, size: int, group: Any) -> None:
        super().__init__()
        self.group = group
        (self.dim,) = norm.normalized_shape
        self.eps = norm.eps
        weight = norm.weight
        self.weight = None if weight is None else nn.Parameter(_shard(weight.data, 0, rank, size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        out = (xf * torch.rsqrt(squares / self.dim + eps)).type_as(x)  # as F.rms_norm: normalize in fp32, cast
        return out if self.weight is None else out * self.weight


def _replacement(module: nn.Module, style: ShardStyle, rank: int, size: int, group: Any,
                 parent: nn.Module) -> nn.Module:
    if isinstance(style, Colwise):
        assert isinstance(module, nn.Linear), f"Colwise needs nn.Linear, got {type(module).__name__}"
        chunks = tuple(int(getattr(parent, a)) for a in style.parts_from) if style.parts_from else style.chunks
        return ColumnParallelLinear(module, rank, size, chunks)
    if isinstance(style, Rowwise):
        assert isinstance(module, nn.Linear), f"Rowwise needs nn.Linear, got {type(module).__name__}"
        return RowParallelLinear(module, rank, size, group, style.parts)
    assert isinstance(style, HeadNorm) and isinstance(module, nn.RMSNorm), f"HeadNorm needs nn.RMSNorm, got {module}"
    return HeadShardedRMSNorm(module, rank, size, group)


def apply_tensor_parallel(model: nn.Module, plan: TensorPlan, group: Any) -> int:
    """Shard ``model`` in place by ``plan`` over ``group``; returns the modules replaced."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    rules = [(re.compile(pattern), style) for pattern, style in plan.rules]
    targets = []
    for name, module in model.named_modules():
        style = next((s for r, s in rules if r.fullmatch(name)), None)
        if style is not None:
            targets.append((name, module, style))
    assert targets, "the tensor plan matched no module of the model"
    for name, module, style in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _replacement(module, style, rank, size, group, parent))
    widths = [(re.compile(plan.heads), attr) for attr in plan.head_attrs]
    widths += [(re.compile(pattern), attr) for pattern, attr in plan.divide]
    for name, module in model.named_modules():
        for regex, attr in widths:
            if regex.fullmatch(name):
                value = getattr(module, attr)
                assert value % size == 0, f"{name}.{attr} = {value} does not split over tp={size}"
                setattr(module, attr, value // size)
    return len(targets)
