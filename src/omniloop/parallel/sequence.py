"""Sequence sharding around a block stack: ``run_blocks`` hands the stack to
:class:`SequenceShard` when one is installed on it (``blocks.sequence_shard``).

Each of the ``sp`` ranks keeps a contiguous shard of the tokens (sizes differ by at most
one, so any L works and no padding token enters a computation); the token-aligned block
arguments (RoPE tables, per-token modulation) are split the same way; the blocks run on
the shard, with Ulysses / ring attention (``sp_attention.py``) where they attend over the
whole sequence; the output is gathered. While the stack runs, the shard sizes are this
thread's :func:`current_layout` (per forward, never per module).

Block interceptors (cache plugins) run inside, on the shards: their decision statistics
are reduced over the sp group (``ext/reduce.py``), so every rank skips alike.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from omniloop.models.layers.run_blocks import BlockInterceptor, BlockStack, run_block_stack
from omniloop.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class SequenceLayout:
    """How one forward's ``L`` tokens are split: ``sizes[s]`` tokens on sp rank ``s``
    (contiguous, in order); sp rank = ring coordinate x ulysses + ulysses coordinate."""

    sizes: tuple[int, ...]
    ulysses: int
    ring: int

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def ulysses_sizes(self, ring_index: int) -> tuple[int, ...]:
        """The shard sizes of the ulysses group at ``ring_index`` (its tokens are contiguous)."""
        return self.sizes[ring_index * self.ulysses:(ring_index + 1) * self.ulysses]

    def ring_sizes(self) -> tuple[int, ...]:
        """Tokens per ring block (one ulysses group's tokens each)."""
        return tuple(sum(self.ulysses_sizes(r)) for r in range(self.ring))


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """``total`` tokens in ``parts`` contiguous shards, the first ``total % parts`` one longer."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


_local = threading.local()


def current_layout() -> SequenceLayout | None:
    """The layout of the sharded block stack running on this thread (None outside one)."""
    return getattr(_local, "layout", None)


@contextmanager
def _using(layout: SequenceLayout | None) -> Iterator[None]:
    previous = current_layout()
    _local.layout = layout
    try:
        yield
    finally:
        _local.layout = previous


class SequenceShard:
    """Installed as ``blocks.sequence_shard`` by :func:`shard_sequence` (deployment state:
    the sp group and which arguments are per token; nothing per request)."""

    def __init__(self, mesh: ParallelMesh, token_args: Sequence[int | tuple[int, int]], dim: int = 1) -> None:
        self.group = mesh.group("sp")
        self.rank = mesh.coordinate("sp")
        self.ulysses, self.ring = mesh.spec.ulysses, mesh.spec.ring
        # argument index -> its token dim (SequencePlan.token_args: an index alone is dim 1)
        self.token_args = dict(a if isinstance(a, tuple) else (a, 1) for a in token_args)
        self.dim = dim

    @property
    def size(self) -> int:
        return self.ulysses * self.ring

    def run(self, blocks: BlockStack, hidden: torch.Tensor, args: tuple, kwargs: dict[str, Any],
            interceptor: BlockInterceptor | None) -> torch.Tensor:
        total = hidden.shape[self.dim]
        if total < self.size:  # fewer tokens than ranks: every rank runs the whole stack (no comm)
            return run_block_stack(blocks, hidden, *args, interceptor=interceptor, **kwargs)
        layout = SequenceLayout(split_sizes(total, self.size), self.ulysses, self.ring)
        start = sum(layout.sizes[:self.rank])
        size = layout.sizes[self.rank]
        local_args = tuple(self._shard(a, total, start, size, self.token_args[i]) if i in self.token_args else a
                           for i, a in enumerate(args))
        with _using(layout):
            out = run_block_stack(blocks, hidden.narrow(self.dim, start, size), *local_args,
                                  interceptor=interceptor, **kwargs)
        return gather_sequence(out, layout.sizes, self.group, self.dim)

    def _shard(self, value: Any, total: int, start: int, size: int, dim: int) -> Any:
        """The rank's tokens of a per-token argument (tokens along ``dim``); of one with G rows
        for G equal groups of tokens, a row per token of the window; a broadcast one (dim size 1)
        as is; an object with ``narrow_tokens(start, size)`` (a packed sequence's ``Segments``)
        gives its own window."""
        if callable(getattr(value, "narrow_tokens", None)):
            return value.narrow_tokens(start, size)
        if isinstance(value, torch.Tensor):
            rows = value.shape[dim] if value.ndim > dim else 1
            if rows == total:
                return value.narrow(dim, start, size)
            if 1 < rows < total and total % rows == 0:
                # G rows, each for total / G consecutive tokens (layers/wan_dit.TokenRows: Wan2.2
                # TI2V's per-frame modulation); a window may start mid-group: its tokens' rows
                index = torch.arange(start, start + size, device=value.device) // (total // rows)
                return value.index_select(dim, index)
            return value
        if isinstance(value, tuple):
            items = [self._shard(v, total, start, size, dim) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return value


def gather_sequence(local: torch.Tensor, sizes: Sequence[int], group: Any, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (shards padded to one size on the wire)."""
    longest = max(sizes)
    pad = longest - local.shape[dim]
    if pad:
        local = torch.cat([local, local.new_zeros(*local.shape[:dim], pad, *local.shape[dim + 1:])], dim=dim)
    parts = [torch.empty_like(local) for _ in sizes]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def shard_sequence(model: nn.Module, blocks_attr: str, mesh: ParallelMesh,
                   token_args: Sequence[int | tuple[int, int]], token_dim: int = 1) -> None:
    """Install the sequence shard on ``model.<blocks_attr>`` (the ModuleList it passes to
    run_blocks); ``token_dim``: the hidden states' token dim (1: ``[B, L, D]``; 0: packed ``[N, D]``)."""
    blocks = getattr(model, blocks_attr)
    blocks.sequence_shard = SequenceShard(mesh, token_args, token_dim)
