"""Cache statistics are reduced over the sequence-parallel group only, so ranks agree.

Two gloo processes each hold half of the tokens (the sequence-parallel layout); DBCache
decides on group-averaged statistics: both ranks take the same decisions, equal to the
single-process run on the whole sequence — while their local statistics alone would
disagree.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from torch import nn

from omniloop.ext.cache.dbcache import DBCache, DBCacheConfig
from omniloop.ext.interceptors import BlockSegment, PluginLoopState, SegmentedBlockRun
from omniloop.ext.reduce import group_mean, relative_l1
from omniloop.ext.scope import Segment
from omniloop.models.layers.run_blocks import run_blocks

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


def _rank(rank: int, world: int, init_file: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    half = TOKENS // world
    shard = slice(rank * half, (rank + 1) * half)
    out.put((rank, run_dbcache(shard, dist.group.WORLD), run_dbcache(shard, None)))
    dist.barrier()
    dist.destroy_process_group()


def test_single_process_reduction_is_the_identity():
    stats = torch.tensor([[0.5, 2.0]])
    assert group_mean(stats, None) is stats
    prev, cur = torch.ones(3, 4), torch.full((3, 4), 1.1)
    assert relative_l1([(prev, cur)]) == [((prev - cur).abs().mean() / prev.abs().mean()).item()]


def test_ranks_agree_through_the_group_reduction(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, reduced, local = queue.get()
        results[rank] = (reduced, local)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    whole = run_dbcache(slice(None), None)
    assert results[0][0] == results[1][0] == whole, "ranks decide alike, as on the whole sequence"
    assert 0 < len(whole) < STEPS
    assert results[0][1] != results[1][1], "shard-local statistics alone would disagree (the hazard)"
