"""Paged text KV: block accounting and "no room" as a return value, slots through block
tables, the batched view's gather / padding / mask, and its equality with contiguous KV."""

from __future__ import annotations

import pytest
import torch

from omniloop.cache.kv import KVBatch, KVHandle, KVLayout
from omniloop.cache.paged_kv import BlockPool, PagedKVBatch, build_text_kv_pool
from omniloop.models.layers.attention import attention

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
BPT = LAYOUT.bytes_per_token(torch.float32)  # 128 bytes a token


def _pool(blocks=6, block_size=4):
    return BlockPool(LAYOUT, dtype=torch.float32, device="cpu", budget_bytes=blocks * block_size * BPT,
                     block_size=block_size)


def test_blocks_are_carved_from_the_budget_and_no_room_is_a_return_value():
    pool = _pool()
    assert pool.num_blocks == 6 and pool.capacity_tokens == 24 and pool.nbytes == 0  # materialized lazily
    a, b = pool.handle(), pool.handle()
    assert a.reserve(9) and len(a.block_table) == 3 and a.capacity == 12
    assert a.reserve(12) and len(a.block_table) == 3  # already enough
    assert b.reserve(12) and pool.free_blocks == 0
    assert not b.reserve(13) and len(b.block_table) == 3  # nothing taken on failure
    assert pool.nbytes == 2 * 2 * 24 * 2 * 4 * 4
    a.drop()
    assert pool.free_blocks == 3 and a.num_tokens == 0 and not a.freed
    assert b.reserve(24)
    b.free()
    b.free()  # idempotent
    assert b.freed and pool.free_blocks == 6 and b.nbytes == 0
    with pytest.raises(AssertionError, match="freed"):
        b.reserve(1)


def test_budget_errors_name_what_to_pass():
    with pytest.raises(ValueError, match="smaller than one block.*kv_cache_gb"):
        BlockPool(LAYOUT, dtype=torch.float32, device="cpu", budget_bytes=100)
    with pytest.raises(ValueError, match="needs 7 KV blocks but the text KV pool holds 6.*sampling.max_tokens"):
        _pool().check_fits(25)
    pool = build_text_kv_pool(LAYOUT, dtype=torch.float32, device="cpu", max_context=64)
    assert pool.num_blocks == 8 * 64 // 16  # default: 8 full contexts


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, 2, 4, generator=g), torch.randn(1, n, 2, 4, generator=g)


def test_paged_view_equals_a_contiguous_kv_for_one_and_several_rows():
    pool = _pool(blocks=8, block_size=2)
    paged = [pool.handle() for _ in range(2)]
    flat = [KVHandle(LAYOUT, dtype=torch.float32, device="cpu") for _ in range(2)]
    lengths = (5, 2)
    # interleave allocations so the rows' blocks are not contiguous in the pool
    for step in range(5):
        for row, n in enumerate(lengths):
            if step < n:
                k, v = _kv(1, 10 * row + step)
                assert paged[row].reserve(paged[row].num_tokens + 1)
                pb, fb = PagedKVBatch([paged[row]], 1), KVBatch([flat[row]], 1)
                for layer in range(2):
                    kp, vp = pb.update(layer, k, v)
                    kf, vf = fb.update(layer, k, v)
                    assert torch.equal(kp, kf) and torch.equal(vp, vf)
    assert paged[0].block_table != list(range(len(paged[0].block_table)))
    for h, f in zip(paged, flat):
        assert torch.equal(h.view(1)[0], f.view(1)[0])
    # both rows in one decode step: padded to the longest, masked, the same as KVBatch
    for h in paged:
        assert h.reserve(h.num_tokens + 1)
    pb, fb = PagedKVBatch(paged, 1), KVBatch(flat, 1)
    assert torch.equal(pb.positions, fb.positions) and torch.equal(pb.mask, fb.mask)
    k, v = torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4)
    kp, vp = pb.update(0, k, v)
    kf, vf = fb.update(0, k, v)
    keep = pb.mask[:, 0, 0, :, None, None]
    assert torch.equal(kp * keep, kf) and torch.equal(vp * keep, vf)
    assert torch.isfinite(kp).all()  # padding reads finite slots (the pool starts at zeros)
    q = torch.randn(2, 1, 4, 4)
    torch.testing.assert_close(attention(q, kp, vp, mask=pb.mask), attention(q, kf, vf, mask=fb.mask))


def test_a_view_needs_reserved_room():
    pool = _pool()
    h = pool.handle()
    with pytest.raises(AssertionError, match="reserve"):
        PagedKVBatch([h], 1)
