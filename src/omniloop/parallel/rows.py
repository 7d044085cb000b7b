"""CFG and data parallelism: the forwards of one denoise step split across the dp x cfg ranks.

A step's forwards are (request, guidance branch) pairs. Pair ``(i, b)`` belongs to row rank
``(i mod dp) * cfg + (index of b mod cfg)``: with ``cfg=2`` the cond and uncond forwards of
a request run on two ranks, with ``dp=2`` the requests of a batched step alternate. Each
rank runs its pairs (its interceptor states are its pairs' states: a pair always lands on
the same rank, step after step), then one all-gather gives every rank every prediction, so
the CFG combine and the sampler update run identically everywhere and every rank keeps
every request's full state (the scheduler on rank 0 never needs to know where a row ran).

A ``DenoiseLoop`` reads this placement from ``StageContext.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from omniloop.parallel.mesh import ParallelMesh

Call = tuple[int, str]  # (loop index in the step, guidance branch)


@dataclass(frozen=True)
class RowPlacement:
    dp: int
    cfg: int
    index: int  # this rank's coordinate in the rows group (dp coordinate * cfg + cfg coordinate)
    group: Any

    @classmethod
    def for_mesh(cls, mesh: ParallelMesh) -> RowPlacement | None:
        if mesh.spec.rows == 1:
            return None
        return cls(mesh.spec.dp, mesh.spec.cfg, mesh.coordinate("rows"), mesh.group("rows"))

    @property
    def size(self) -> int:
        return self.dp * self.cfg

    def owner(self, call: Call, branches: Sequence[str]) -> int:
        loop, branch = call
        return (loop % self.dp) * self.cfg + branches.index(branch) % self.cfg

    def local_calls(self, calls: Sequence[Call], branches: Sequence[str]) -> list[Call]:
        """The calls this rank computes, in the order given."""
        return [c for c in calls if self.owner(c, branches) == self.index]

    def exchange(self, out: list[dict[str, dict[str, torch.Tensor]]], calls: Sequence[Call],
                 branches: Sequence[str], like: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Fill ``out[i][b]`` of every call from the rank that computed it. ``like[i]``: loop
        i's latents (its predictions have their shapes; every rank knows them). One all-gather:
        each rank sends its calls' float32 predictions flattened into one buffer, padded to
        the largest rank's."""
        by_rank: list[list[Call]] = [[] for _ in range(self.size)]
        for call in calls:
            by_rank[self.owner(call, branches)].append(call)
        numel = [sum(like[i][m].numel() for i, _ in owned for m in like[i]) for owned in by_rank]
        longest = max(numel)
        if longest == 0:
            return
        device = next(iter(like[calls[0][0]].values())).device
        send = torch.zeros(longest, dtype=torch.float32, device=device)
        mine = [out[i][b][m].reshape(-1) for i, b in by_rank[self.index] for m in sorted(like[i])]
        if mine:
            torch.cat(mine, out=send[:numel[self.index]])
        gathered = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(gathered, send, group=self.group)
        for rank, owned in enumerate(by_rank):
            if rank == self.index:
                continue
            offset = 0
            for i, b in owned:
                for m in sorted(like[i]):
                    ref = like[i][m]
                    out[i].setdefault(b, {})[m] = gathered[rank][offset:offset + ref.numel()].view(ref.shape)
                    offset += ref.numel()
