"""Paged text KV: the text-KV class of the cache manager (design §6.3.2).

A :class:`BlockPool` carves a byte budget, once, into fixed-size blocks of ``block_size``
token slots holding K and V for every layer: ``k, v [layers, num_blocks * block_size,
H_kv, D]``. A request owns a :class:`PagedKVHandle`: a block table (the blocks holding its
positions, in order) and its token count. A forward sees a :class:`PagedKVBatch`: the new
tokens' keys/values are written at their slots, and attention reads every row's context
gathered through its block table (a gather-based paged attention through the attention
registry: rows of different lengths are padded to the longest and masked).

"No room" is a return value: ``reserve`` answers False and allocates nothing. Who gives way
is the AR loop's decision (preemption by recompute: a victim's blocks are freed, and it
later re-prefills its prompt and the tokens it already produced).

Vocabulary: a *slot* is one token position in the pool (``block * block_size + offset``);
``capacity`` of a handle is ``len(block_table) * block_size``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from omniloop.cache.kv import KVLayout
from omniloop.request import InvalidRequest

DEFAULT_BLOCK_TOKENS = 16
CPU_DEFAULT_BYTES = 1 << 30  # no budget given on a CPU: at most 1 GiB
CUDA_DEFAULT_FRACTION = 0.25  # no budget given on a GPU: at most a quarter of the free memory
DEFAULT_REQUESTS = 8  # ... and at most this many requests at their full context


def default_kv_budget(layout: KVLayout, dtype: torch.dtype, device: torch.device | str, max_context: int) -> int:
    """Bytes for the pool when the deployment names no ``kv_cache_gb``: room for
    ``DEFAULT_REQUESTS`` full contexts, capped by the device's share."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * CUDA_DEFAULT_FRACTION)
    else:
        cap = CPU_DEFAULT_BYTES
    return min(cap, DEFAULT_REQUESTS * max_context * layout.bytes_per_token(dtype))


class BlockPool:
    """Fixed-size KV blocks for every layer, carved once from ``budget_bytes``."""

    def __init__(self, layout: KVLayout, *, dtype: torch.dtype, device: torch.device | str, budget_bytes: int,
                 block_size: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_size < 1:
            raise ValueError(f"KV block_size must be >= 1, got {block_size}")
        self.layout, self.dtype, self.device, self.block_size = layout, dtype, torch.device(device), block_size
        self.block_bytes = block_size * layout.bytes_per_token(dtype)
        self.num_blocks = int(budget_bytes // self.block_bytes)
        if self.num_blocks < 1:
            raise ValueError(
                f"the text KV budget of {budget_bytes} bytes is smaller than one block ({self.block_bytes} bytes: "
                f"{block_size} tokens x {layout.num_layers} layers); pass a larger kv_cache_gb"
            )
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # a stack: low ids first
        self._total_blocks = self.num_blocks  # the storage's blocks (num_blocks drops by the scratch block)
        self._k: torch.Tensor | None = None  # [layers, slots, H_kv, D], materialized at first use
        self._v: torch.Tensor | None = None
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per-layer views of _k/_v, made once
        self._scratch: int | None = None  # a block no request owns (scratch_slot), taken at first use

    # -- accounting -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (the whole budget once materialized)."""
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= len(self._free)

    def check_fits(self, tokens: int) -> None:
        """Admission: one request of ``tokens`` positions must fit the empty pool."""
        if self.blocks_for(tokens) > self.num_blocks:
            raise InvalidRequest(
                f"a request of {tokens} tokens (prompt + sampling.max_tokens) needs {self.blocks_for(tokens)} KV blocks "
                f"but the text KV pool holds {self.num_blocks} ({self.capacity_tokens} tokens); lower "
                "sampling.max_tokens or deploy with a larger kv_cache_gb", fields=("sampling.max_tokens",)
            )

    # -- blocks ------------------------------------------------------------------------------
    def allocate(self, blocks: int) -> list[int] | None:
        """``blocks`` free block ids, or None (nothing taken) when there are fewer free."""
        if blocks > len(self._free):
            return None
        self._materialize()
        return [self._free.pop() for _ in range(blocks)]

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))
        assert len(self._free) <= self.num_blocks, "a KV block was freed twice"

    def scratch_slot(self) -> int:
        """The first slot of a block taken from the pool for good, the first time it is asked
        for: fixed-shape (CUDA-graph) decode steps write their pad rows there and read it for
        masked keys (cache/decode_graph.py). The pool holds one block less from then on."""
        if self._scratch is None:
            taken = self.allocate(1)
            if taken is None:
                raise ValueError("the text KV pool has no free block for the CUDA-graph decode path's scratch slot; "
                                 "pass a larger kv_cache_gb")
            self.num_blocks -= 1
            self._scratch = taken[0] * self.block_size
        return self._scratch

    def handle(self) -> "PagedKVHandle":
        return PagedKVHandle(self)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` storage of ``layer``: ``[slots, H_kv, D]`` each."""
        self._materialize()
        return self._layers[layer]

    def _materialize(self) -> None:
        if self._k is None:
            # zeros, not empty: gathered padding rows must hold finite values (masked scores
            # are -inf, but 0 * NaN in the value product would still be NaN)
            shape = (self.layout.num_layers, self._total_blocks * self.block_size, self.layout.num_kv_heads,
                     self.layout.head_dim)
            self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._layers = list(zip(self._k.unbind(0), self._v.unbind(0)))  # no select op per layer per step

    def drop_storage(self) -> int:
        """Free the pool's storage while no request holds a block (the engine's sleep); the
        next allocation makes it again, zeroed (woken KV starts empty: sessions re-prefill).
        Returns the bytes freed (0 when some block is held: nothing is dropped then)."""
        if len(self._free) < self.num_blocks:
            return 0
        freed = self.nbytes
        self._k = self._v = None
        self._layers = []
        return freed

    def __repr__(self) -> str:
        used = self.num_blocks - len(self._free)
        return f"BlockPool({used}/{self.num_blocks} blocks of {self.block_size} tokens, {self.block_bytes} B each)"


class PagedKVHandle:
    """One request's positions in a :class:`BlockPool`: its block table and token count."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_table: list[int] = []
        self.num_tokens = 0
        self.freed = False
        self._table: torch.Tensor | None = None  # block_table as a CPU tensor, made when first asked for

    def table(self) -> torch.Tensor:
        """``[len(block_table)]`` int64 on the CPU, kept until the table changes (a batch's
        index building reads it every step; it changes once every ``block_size`` tokens)."""
        if self._table is None:
            self._table = torch.tensor(self.block_table, dtype=torch.long)
        return self._table

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        return len(self.block_table) * self.pool.block_bytes

    @property
    def used_nbytes(self) -> int:
        return self.num_tokens * self.pool.layout.bytes_per_token(self.pool.dtype)

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def blocks_needed(self, total_tokens: int) -> int:
        return max(0, self.pool.blocks_for(total_tokens) - len(self.block_table))

    def reserve(self, total_tokens: int) -> bool:
        """Hold blocks for ``total_tokens`` positions; False (nothing allocated) if the pool has no room."""
        assert not self.freed, "reserve on a freed PagedKVHandle"
        need = self.blocks_needed(total_tokens)
        if need == 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        self.block_table += blocks
        self._table = None
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget every position past ``num_tokens`` (a forward that failed midway wrote some
        layers only; the next forward overwrites those slots). The blocks stay reserved."""
        assert not self.freed, "rollback of a freed PagedKVHandle"
        self.num_tokens = min(self.num_tokens, num_tokens)

    def drop(self) -> None:
        """Give every block back (preemption); the handle stays usable, empty."""
        self.pool.release(self.block_table)
        self.block_table, self.num_tokens, self._table = [], 0, None

    def free(self) -> None:
        """Give every block back; idempotent. The handle cannot be used afterwards."""
        if not self.freed:
            self.drop()
            self.freed = True

    def slots(self, start: int, count: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[count]`` int64 pool slots of positions ``start .. start + count - 1`` (built on the
        CPU; moved to ``device``, the pool's when None)."""
        pos = torch.arange(start, start + count)
        table = self.table()
        slots = table[pos // self.pool.block_size] * self.pool.block_size + pos % self.pool.block_size
        return slots.to(self.device if device is None else device)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer``, each ``[num_tokens, H_kv, D]`` (gathered copies)."""
        k, v = self.pool.layer(layer)
        idx = self.slots(0, self.num_tokens)
        return k[idx], v[idx]

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{self.num_tokens}/{self.capacity} tokens in {len(self.block_table)} blocks"
        return f"PagedKVHandle({state})"


class PagedKVBatch:
    """The KV one forward sees: ``handles`` (one per batch row) each taking ``num_new`` tokens.

    Built before the forward (every handle must already hold the capacity: ``reserve``);
    it advances the handles' token counts, so positions and the mask are computed once and
    shared by every layer. One row attends its gathered context with the causal flag and
    no mask; several rows of different lengths are padded to the longest and masked.
    """

    causal = True

    def __init__(self, handles: Sequence[PagedKVHandle], num_new: int) -> None:
        assert handles and num_new >= 1, "PagedKVBatch needs handles and new tokens"
        self.handles = list(handles)
        self.num_new = num_new
        self.pool = self.handles[0].pool
        for h in self.handles:
            assert h.capacity >= h.num_tokens + num_new, f"{h} lacks room for {num_new} tokens: reserve() first"
        self.starts = [h.num_tokens for h in self.handles]  # [B] host ints: positions[:, 0]
        positions, write, read = self._indices()
        # every index is built on the CPU in a few whole-batch ops and crosses to the device
        # in ONE copy (not one per row or per layer); the layers reuse them
        b, lk = read.shape
        flat = torch.cat((positions.reshape(-1), write, read.reshape(-1))).to(self.pool.device)
        n = b * num_new
        self.positions = flat[:n].view(b, num_new)  # [B, Lq]
        self._write, self._read = flat[n:2 * n], flat[2 * n:]  # [B * Lq], [B * Lk] (pad: slot 0)
        self._read_shape = (b, lk)
        self.mask: torch.Tensor | None = None  # [B, 1, Lq, Lk] bool, True = attend
        if b > 1:  # built on the device from the positions: no host mask, no second copy
            keys = torch.arange(lk, device=self.pool.device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]
        for h in self.handles:
            h.num_tokens += num_new

    def _indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU int64 ``positions [B, Lq]``, write slots ``[B * Lq]``, read slots ``[B, Lk]``
        (``Lk`` the longest context after this forward; a shorter row's tail reads slot 0)."""
        bs, num_new = self.pool.block_size, self.num_new
        past = torch.tensor(self.starts)  # [B]
        table = pad_sequence([h.table() for h in self.handles], batch_first=True)  # [B, nb] (pad: block 0)
        positions = past[:, None] + torch.arange(num_new)  # [B, Lq]
        write = (table.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
        longest = max(self.starts) + num_new  # a Python int: no scalar read
        keys = torch.arange(longest)  # [Lk]
        read = table[:, keys // bs] * bs + keys % bs  # [B, Lk]
        read = torch.where(keys < (past + num_new)[:, None], read, 0)
        return positions, write, read

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` (``[B, Lq, H_kv, D]``) at the rows' slots; return every row's keys/values ``[B, Lk, H_kv, D]``."""
        assert k.shape[:2] == (len(self.handles), self.num_new), f"PagedKVBatch got k {tuple(k.shape)}"
        kp, vp = self.pool.layer(layer)
        kp.index_copy_(0, self._write, _as(k.reshape(-1, *k.shape[2:]), kp.dtype))
        vp.index_copy_(0, self._write, _as(v.reshape(-1, *v.shape[2:]), vp.dtype))
        # one index_select per tensor for the whole batch (cheaper to dispatch than kp[read])
        shape = (*self._read_shape, *kp.shape[1:])
        return kp.index_select(0, self._read).view(shape), vp.index_select(0, self._read).view(shape)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # no dispatch when the pool has the model's dtype


def build_text_kv_pool(layout: KVLayout, *, dtype: torch.dtype, device: torch.device | str, max_context: int,
                       kv_cache_gb: float | None = None, block_size: int = DEFAULT_BLOCK_TOKENS) -> BlockPool:
    """The deployment's text-KV pool: ``kv_cache_gb`` when given, else :func:`default_kv_budget`."""
    budget = int(kv_cache_gb * 2**30) if kv_cache_gb is not None else default_kv_budget(layout, dtype, device, max_context)
    return BlockPool(layout, dtype=dtype, device=device, budget_bytes=budget, block_size=block_size)
