"""Bucketed decode inputs (cache/decode_graph.py): padding rows and block tables to fixed
buckets keeps every real row's slots, positions and token equal to PagedKVBatch's."""

from __future__ import annotations

import pytest
import torch

from omniloop.cache.decode_graph import StaticDecodeKV, batch_bucket, blocks_bucket, decode_inputs
from omniloop.cache.kv import KVLayout
from omniloop.cache.paged_kv import BlockPool, PagedKVBatch

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4)


def _pool(blocks=40, block_size=4):
    return BlockPool(LAYOUT, dtype=torch.float32, device="cpu", budget_bytes=blocks * block_size * LAYOUT.bytes_per_token(torch.float32),
                     block_size=block_size)


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 32, 33)] == [1, 2, 4, 8, 16, 32, 32, None]
    assert [blocks_bucket(n) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]


def test_scratch_slot_is_taken_once_and_leaves_admission_honest():
    pool = _pool(blocks=3)
    slot = pool.scratch_slot()
    assert pool.scratch_slot() == slot and pool.num_blocks == 2 and pool.free_blocks == 2
    h = pool.handle()
    assert h.reserve(8) and slot // pool.block_size not in h.block_table
    with pytest.raises(ValueError, match="needs 3 KV blocks but the text KV pool holds 2"):
        pool.check_fits(9)
    full = _pool(blocks=1)
    full.handle().reserve(1)
    with pytest.raises(ValueError, match="scratch slot.*kv_cache_gb"):
        full.scratch_slot()


def test_padded_inputs_keep_every_real_row_and_mask_the_rest():
    pool = _pool()
    handles = [pool.handle() for _ in range(3)]
    for h, n in zip(handles, (5, 13, 2)):  # interleaved, non-contiguous blocks
        assert h.reserve(n + 1)
        h.num_tokens = n
    pad = pool.scratch_slot()
    t = decode_inputs(handles, [7, 8, 9], batch=4, blocks=8, pad_slot=pad)
    ref = PagedKVBatch(handles, 1)  # advances the handles: the eager path's indices
    lk = 8 * pool.block_size
    assert t["ids"].tolist() == [[7], [8], [9], [0]] and t["positions"].tolist() == [[5], [13], [2], [0]]
    assert torch.equal(t["write"][:3], ref._write) and t["write"][3] == pad
    read = t["read"].view(4, lk)
    eager = ref._read.view(3, -1)  # [3, 14]: the longest context after the step
    for row, n in enumerate((6, 14, 3)):
        assert torch.equal(read[row, :n], eager[row, :n])
        assert (read[row, n:] == pad).all()
    assert (read[3] == pad).all()
    kv = StaticDecodeKV(pool, t["positions"], t["write"], t["read"])
    assert kv.mask.shape == (4, 1, 1, lk) and kv.mask.sum(-1).flatten().tolist() == [6, 14, 3, 1]
    assert torch.equal(kv.mask[:3, ..., :14], ref.mask)
    with pytest.raises(AssertionError, match="more than the bucket"):
        decode_inputs(handles, [1, 2, 3], batch=4, blocks=1, pad_slot=pad)
