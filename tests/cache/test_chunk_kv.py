"""Chunk-KV slab pool and per-request handles: recycling, sink/window policies, training
mode, the byte budget, host offload and the events the cache_event hook receives."""

from __future__ import annotations

import pytest
import torch

from omniloop.cache.chunk_kv import ChunkKVExhausted, ChunkKVHandle, ChunkKVPool, SlabLayout, TierPolicy

LAYOUT = SlabLayout(num_layers=2, num_heads=2, head_dim=4, tokens=6, dtype=torch.float32)  # 384 B


def _kv(seed: int, tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 2, 4, generator=g), torch.randn(tokens, 2, 4, generator=g)


def _write_chunk(handle: ChunkKVHandle, tier: str, chunk: int, seed: int = 0) -> None:
    for row in handle.rows:
        for layer in range(LAYOUT.num_layers):
            handle.write(tier, row, chunk, layer, *_kv(seed + 10 * chunk + layer))


def test_released_slabs_are_recycled_and_the_budget_holds():
    pool = ChunkKVPool(3 * LAYOUT.nbytes, "cpu")
    slabs = [pool.alloc(LAYOUT) for _ in range(3)]
    assert all(s is not None for s in slabs) and pool.alloc(LAYOUT) is None  # "no room" is a value
    ptr = slabs[1].data.data_ptr()
    pool.release(slabs[1])
    again = pool.alloc(LAYOUT)
    assert again is not None and again.data.data_ptr() == ptr  # the same storage, recycled
    assert pool.counts["recycled"] == 1 and pool.allocated_bytes == 3 * LAYOUT.nbytes
    # free storage of another layout is given back when a new layout needs the room
    pool.release(again)
    other = SlabLayout(num_layers=2, num_heads=2, head_dim=4, tokens=3, dtype=torch.float32)
    assert pool.alloc(other) is not None and pool.allocated_bytes == 2 * LAYOUT.nbytes + other.nbytes


def test_sink_and_window_recycle_out_of_window_chunks_and_report_events():
    events = []
    pool = ChunkKVPool(1 << 20, "cpu")
    handle = ChunkKVHandle(pool, {"kv": LAYOUT}, {"kv": TierPolicy(sink=1, window=2)}, ("cond", "uncond"),
                           on_event=lambda *e: events.append(e))
    for chunk in range(6):
        _write_chunk(handle, "kv", chunk)
        handle.retire(chunk)
        assert pool.in_use_bytes <= 2 * 3 * LAYOUT.nbytes  # sink + window, per row
    assert handle.chunks("kv") == [0, 4, 5]
    evicted = sorted({c for kind, _, c, _ in events if kind == "evict"})
    assert evicted == [1, 2, 3]
    assert sum(kind == "alloc" for kind, *_ in events) == 12  # 6 chunks x 2 rows
    # recycled slabs served the later chunks: only sink + window + the chunk in flight were ever allocated
    assert pool.allocated_bytes == 2 * 4 * LAYOUT.nbytes
    # reads return what was written, in chunk order
    (k0, v0), (k4, _), _ = handle.kv("kv", "uncond", [0, 4, 5], layer=1)
    assert torch.equal(k0, _kv(1)[0]) and torch.equal(v0, _kv(1)[1]) and torch.equal(k4, _kv(41)[0])
    handle.free()
    assert pool.in_use_bytes == 0 and handle.freed


def test_training_mode_recycles_nothing_and_keeps_gradients():
    pool = ChunkKVPool(LAYOUT.nbytes, "cpu")  # references use none of the budget
    handle = ChunkKVHandle(pool, {"kv": LAYOUT}, {"kv": TierPolicy(window=1)}, ("cond",), training=True)
    k = torch.randn(6, 2, 4, requires_grad=True)
    for chunk in range(3):
        for layer in range(2):
            handle.write("kv", "cond", chunk, layer, k * (chunk + 1), k * 2)
        handle.retire(chunk)
    assert handle.chunks("kv") == [0, 1, 2]  # nothing recycled
    assert handle.chunks("kv", newest=2) == [2]  # ... but attention sees the window only
    (k_seen, _), = handle.kv("kv", "cond", [2], layer=0)
    k_seen.sum().backward()
    assert torch.equal(k.grad, torch.full_like(k, 3.0))  # the graph runs through the KV
    assert pool.in_use_bytes == 0


def test_offload_frees_device_bytes_and_restore_brings_the_same_values_back():
    events = []
    pool = ChunkKVPool(1 << 20, "cpu")
    handle = ChunkKVHandle(pool, {"kv": LAYOUT}, {"kv": TierPolicy()}, ("cond",), on_event=lambda *e: events.append(e))
    _write_chunk(handle, "kv", 0)
    before = [t.clone() for t in handle.kv("kv", "cond", [0], 1)[0]]
    handle.offload()
    assert handle.nbytes == 0 and handle.host_nbytes == LAYOUT.nbytes and pool.in_use_bytes == 0
    handle.ensure_resident()
    after = handle.kv("kv", "cond", [0], 1)[0]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert [e[0] for e in events if e[0] in ("offload", "restore")] == ["offload", "restore"]


def test_exhausted_pool_raises_for_the_request_with_the_fix_in_the_message():
    pool = ChunkKVPool(LAYOUT.nbytes, "cpu")
    handle = ChunkKVHandle(pool, {"kv": LAYOUT}, {"kv": TierPolicy()}, ("cond", "uncond"))
    handle.write("kv", "cond", 0, 0, *_kv(0))
    with pytest.raises(ChunkKVExhausted, match="chunk_kv_budget_gb"):
        handle.write("kv", "uncond", 0, 0, *_kv(0))


def test_peak_bytes_is_what_a_rollout_holds_at_once():
    layouts = {"full": LAYOUT, "small": SlabLayout(2, 2, 4, 2, torch.float32)}
    policies = {"full": TierPolicy(window=2), "small": TierPolicy()}
    peak = ChunkKVPool.peak_bytes(layouts, policies, rows=2, total_chunks=5)
    assert peak == 2 * (3 * LAYOUT.nbytes + 5 * layouts["small"].nbytes)
    with pytest.raises(ValueError, match="open-ended"):
        ChunkKVPool.peak_bytes(layouts, policies, rows=1, total_chunks=None)
    assert ChunkKVPool.peak_bytes({"full": LAYOUT}, {"full": TierPolicy(sink=1, window=2)}, 1, None) == 4 * LAYOUT.nbytes
