"""Statistics reduced over the sequence-parallel group, so every rank decides alike.

Under sequence parallelism each rank holds a shard of the tokens; a cache decision taken
on a local residual would differ between ranks and deadlock the next collective. Each
rank computes its local means, the group averages them (one all-reduce for every segment
of the forward), and every rank thresholds the same numbers. With equal shards the
average of shard means is the global mean (cache-dit's ``parallelized`` similarity does
the same two averages). Single process (``group=None``) is the identity.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def group_mean(stats: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Mean of ``stats`` over the ranks of ``group``; identity without a group."""
    if group is None:
        return stats
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return stats
    out = stats.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out / world


def relative_l1(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: Any = None) -> list[float]:
    """``mean|prev - cur| / mean|prev|`` per (prev, cur) pair, group-reduced, one host sync.

    Same arithmetic as cache-dit's ``similarity`` and TeaCache's distance (float32 means).
    """
    if not pairs:
        return []
    stats = torch.stack(
        [torch.stack(((prev - cur).abs().mean(), prev.abs().mean())).float() for prev, cur in pairs]
    )  # [n, 2]
    stats = group_mean(stats, group)
    return (stats[:, 0] / stats[:, 1]).tolist()
