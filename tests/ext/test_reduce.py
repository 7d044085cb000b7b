"""Cache statistics are reduced over the sequence-parallel group only, so ranks agree.

Two gloo processes each hold half of the tokens (the sequence-parallel layout); DBCache
decides on group-averaged statistics: both ranks take the same decisions, equal to the
single-process run on the whole sequence — while their local statistics alone would
disagree.
"""

from __future__ import annotations

import torch
from torch import nn

from omniloop.ext.cache.dbcache import DBCache, DBCacheConfig
from omniloop.ext.interceptors import BlockSegment, PluginLoopState, SegmentedBlockRun
from omniloop.ext.reduce import group_mean, relative_l1
from omniloop.ext.scope import Segment
from omniloop.models.layers.run_blocks import run_blocks
from tests.parallel.ranks import run_ranks

STEPS, TOKENS = 12, 8


class AddResidual(nn.Module):
    def forward(self, h, r):
        return h + r


class Pointwise(nn.Module):
    def forward(self, h, r):
        return 0.9 * h + 0.2 * torch.tanh(h)


def sequences() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step: hidden input and first-block residual [1, TOKENS, 4]. The second half of
    the tokens drifts much faster than the first, so shard-local diffs disagree."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(1, TOKENS, 4, generator=g) + 0.5
    xs, rs = [], []
    for t in range(STEPS):
        drift = torch.ones(1, TOKENS, 1)
        drift[:, TOKENS // 2 :] = 1 + 0.35 * ((t * 7) % 5) / 4
        drift[:, : TOKENS // 2] = 1 + 0.02 * ((t * 3) % 4) / 3
        rs.append(base * drift)
        xs.append(torch.randn(1, TOKENS, 4, generator=g))
    return xs, rs


def run_dbcache(shard: slice, group) -> list[int]:
    config = DBCacheConfig(Fn=1, Bn=0, threshold=0.15, warmup_steps=1)
    plugin = DBCache("dbcache", config, sp_group=group)
    blocks = nn.ModuleList([AddResidual(), Pointwise(), Pointwise()])
    state, loop_state = plugin.new_branch_state(), PluginLoopState("dbcache", config)
    for x, r in zip(*sequences()):
        seg = BlockSegment(Segment("r", "cond", None, 0, 1), state, config, STEPS, loop_state)
        run_blocks(blocks, x[:, shard], r[:, shard], interceptor=SegmentedBlockRun(plugin, [seg], None))
    return state.cached_steps


def _rank(rank: int, world: int) -> tuple[list[int], list[int]]:
    """On each of the gloo ranks (``run_on_ranks`` made the group): reduced and local decisions."""
    import torch.distributed as dist

    half = TOKENS // world
    shard = slice(rank * half, (rank + 1) * half)
    return run_dbcache(shard, dist.group.WORLD), run_dbcache(shard, None)


def test_single_process_reduction_is_the_identity():
    stats = torch.tensor([[0.5, 2.0]])
    assert group_mean(stats, None) is stats
    prev, cur = torch.ones(3, 4), torch.full((3, 4), 1.1)
    assert relative_l1([(prev, cur)]) == [((prev - cur).abs().mean() / prev.abs().mean()).item()]


def test_ranks_agree_through_the_group_reduction():
    results = run_ranks(_rank, 2)  # forked from the pool's preloaded forkserver (was spawned: ~10 s)
    whole = run_dbcache(slice(None), None)
    assert results[0][0] == results[1][0] == whole, "ranks decide alike, as on the whole sequence"
    assert 0 < len(whole) < STEPS
    assert results[0][1] != results[1][1], "shard-local statistics alone would disagree (the hazard)"
