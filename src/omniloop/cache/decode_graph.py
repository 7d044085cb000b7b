"""Fixed-shape decode steps over the paged text KV: the inputs a captured CUDA graph replays.

A graph replays fixed shapes, while a decode batch has any number of rows (1..max_batch) and
every row's context grows by one token a step. So a graph-served decode step is **bucketed**:

* rows padded to a batch bucket (:data:`BATCH_BUCKETS`: 1, 2, 4, 8, 16, 32); a pad row
  decodes token 0 at position 0, writes its key/value to the pool's scratch slot
  (:meth:`BlockPool.scratch_slot`, a block no request owns) and reads only that slot;
* every row's block table padded to a blocks-per-row bucket (:func:`blocks_bucket`: powers of
  two from :data:`MIN_BLOCKS`), so the gathered context ``Lk = blocks * block_size`` changes
  only when a row crosses a bucket, not every token; slots past a row's context read the
  scratch slot and are masked;
* the mask is always given (``[B, 1, 1, Lk]``, key <= the row's position) and is built from
  the positions *inside* the graph, so nothing but four small int64 tensors is copied in.

:func:`decode_inputs` builds those tensors on the CPU (plain torch: tested without CUDA);
:class:`StaticDecodeKV` is the KV view a forward over them sees (the same ``update`` /
``positions`` / ``mask`` contract as :class:`~omniloop.cache.paged_kv.PagedKVBatch`). It does
not touch the handles: the caller advances their token counts once the forward has run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from omniloop.cache.paged_kv import BlockPool, PagedKVHandle, _as

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_BLOCKS = 8  # 128 positions at 16 tokens a block: short contexts share one graph


def batch_bucket(rows: int) -> int | None:
    """The smallest batch bucket holding ``rows`` (None: more rows than the largest: eager)."""
    return next((b for b in BATCH_BUCKETS if b >= rows), None)


def blocks_bucket(blocks: int) -> int:
    """Blocks per row padded to a power of two (at least :data:`MIN_BLOCKS`)."""
    out = MIN_BLOCKS
    while out < blocks:
        out *= 2
    return out


def decode_inputs(handles: Sequence[PagedKVHandle], token_ids: Sequence[int], batch: int, blocks: int,
                  pad_slot: int) -> dict[str, torch.Tensor]:
    """CPU int64 inputs of one bucketed decode step: ``ids [batch, 1]`` (the rows' last tokens;
    pad rows 0), ``positions [batch, 1]`` (each row's context length before the step; pad 0),
    ``write [batch]`` (the new token's slot; pad rows ``pad_slot``) and ``read [batch *
    blocks * block_size]`` (every key slot of every row; past its context and for pad rows
    ``pad_slot``). Each handle must hold room for one more token (``reserve``) and at most
    ``blocks`` blocks."""
    assert len(handles) == len(token_ids) <= batch, f"{len(handles)} rows, {len(token_ids)} tokens, bucket {batch}"
    pool = handles[0].pool
    bs = pool.block_size
    for h in handles:
        assert h.capacity >= h.num_tokens + 1, f"{h} lacks room for its next token: reserve() first"
        assert len(h.block_table) <= blocks, f"{h} holds {len(h.block_table)} blocks, more than the bucket's {blocks}"
    pad = batch - len(handles)
    past = torch.tensor([h.num_tokens for h in handles] + [0] * pad)  # [B]
    # pad blocks point at the scratch slot's block; masked or never read
    scratch_block = pad_slot // bs
    table = torch.tensor([h.block_table + [scratch_block] * (blocks - len(h.block_table)) for h in handles]
                         + [[scratch_block] * blocks] * pad)  # [B, nb]
    keys = torch.arange(blocks * bs)  # [Lk]
    read = table[:, keys // bs] * bs + keys % bs  # [B, Lk]
    read = torch.where(keys <= past[:, None], read, pad_slot)  # the new token's slot included
    write = table.gather(1, (past // bs)[:, None])[:, 0] * bs + past % bs  # [B]
    write[len(handles):] = pad_slot
    read[len(handles):] = pad_slot
    ids = torch.tensor(list(token_ids) + [0] * pad)[:, None]
    return {"ids": ids, "positions": past[:, None], "write": write, "read": read.reshape(-1)}


def decode_structure(batch: int, blocks: int, block_size: int) -> tuple:
    """A bucketed decode step's graph key beyond its tensors' shapes."""
    return ("ar_decode", batch, blocks * block_size)


class StaticDecodeKV:
    """The KV view of one bucketed decode step (``num_new`` = 1) over device tensors from
    :func:`decode_inputs`; every op it runs is capturable (no host data, no host sync)."""

    causal = False  # the mask says it all
    num_new = 1
    starts = None  # the positions are device tensors only (replayed from a graph)

    def __init__(self, pool: BlockPool, positions: torch.Tensor, write: torch.Tensor, read: torch.Tensor) -> None:
        self.pool = pool
        b = positions.shape[0]
        self.positions = positions  # [B, 1]
        self._write, self._read = write, read  # [B], [B * Lk]
        self._read_shape = (b, read.shape[0] // b)
        keys = torch.arange(self._read_shape[1], device=positions.device)
        self.mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, 1, Lk]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, 1, H_kv, D]`` at the rows' slots; return ``[B, Lk, H_kv, D]`` each."""
        kp, vp = self.pool.layer(layer)
        kp.index_copy_(0, self._write, _as(k.reshape(-1, *k.shape[2:]), kp.dtype))
        vp.index_copy_(0, self._write, _as(v.reshape(-1, *v.shape[2:]), vp.dtype))
        shape = (*self._read_shape, *kp.shape[1:])
        return kp.index_select(0, self._read).view(shape), vp.index_select(0, self._read).view(shape)
