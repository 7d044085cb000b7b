"""``run_blocks``: the one place a DiT iterates its block stack.

Model code calls ``run_blocks(blocks, hidden, *args, **kwargs)`` instead of writing the
loop, so block-level interceptors (cache acceleration: DBCache/FBCache, TaylorSeer,
TeaCache) plug in from outside the model (STYLE.md 8). With no interceptor it is a plain
loop.

A :class:`BlockInterceptor` is per-forward, built by the loop from per-request, per-branch
state; it is never stored on the model.

Row convention (what lets an interceptor run a block on part of a batch): every tensor
argument is either batch-first (``shape[0] == hidden.shape[0]``) or shared across the batch
(``shape[0] == 1``, e.g. RoPE tables); tuples/NamedTuples of tensors follow the same rule;
an object with ``select_rows(rows)`` (a causal model's per-row KV plan) restricts itself.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
from torch import nn


class BlockStack(Protocol):
    """A model's block stack as ``run_blocks`` takes it: an ``nn.ModuleList`` (no registered
    ``Sequence``) or a list of blocks; block ``i`` by index, all of them in order by iteration."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[nn.Module]: ...

    def __getitem__(self, index: int) -> nn.Module: ...


class BlockInterceptor(Protocol):
    """Runs (or skips) a block stack for one forward.

    ``run(blocks, hidden, call)`` must return the stack's output; ``call(i, hidden)`` runs
    block ``i`` on all rows. An implementation decides which blocks run for which rows and
    substitutes cached or extrapolated residuals for the rest (``call.subset(rows)`` runs
    blocks on a subset of the batch rows).
    """

    def run(self, blocks: BlockStack, hidden: torch.Tensor, call: "BlockCall") -> torch.Tensor: ...


class BlockCall:
    """Runs blocks of one forward with its shared arguments, on all rows or a subset."""

    __slots__ = ("blocks", "args", "kwargs", "batch")

    def __init__(self, blocks: BlockStack, args: tuple, kwargs: dict[str, Any], batch: int) -> None:
        self.blocks = blocks
        self.args = args
        self.kwargs = kwargs
        self.batch = batch  # rows the arguments hold

    def __call__(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks[index](hidden, *self.args, **self.kwargs)

    def range(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        """Blocks ``start..stop-1`` in order (a no-op for an empty range)."""
        for index in range(start, stop):
            hidden = self.blocks[index](hidden, *self.args, **self.kwargs)
        return hidden

    def subset(self, rows: torch.Tensor) -> "BlockCall":
        """The same call with batch-first arguments restricted to ``rows`` ([n] int64)."""
        args = tuple(_select(a, rows, self.batch) for a in self.args)
        kwargs = {k: _select(v, rows, self.batch) for k, v in self.kwargs.items()}
        return BlockCall(self.blocks, args, kwargs, int(rows.numel()))


def _select(value: Any, rows: torch.Tensor, batch: int) -> Any:
    if callable(getattr(value, "select_rows", None)):  # a per-row object (a causal model's KV plan)
        return value.select_rows(rows)
    if isinstance(value, torch.Tensor):
        if value.ndim > 0 and value.shape[0] == batch and batch > 1:
            return value.index_select(0, rows.to(value.device))
        return value
    if isinstance(value, tuple):
        items = [_select(v, rows, batch) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def run_blocks(
    blocks: BlockStack,
    hidden: torch.Tensor,
    *args: Any,
    interceptor: BlockInterceptor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Apply ``blocks`` in order: ``hidden = block(hidden, *args, **kwargs)``.

    A sequence-parallel deployment installs ``blocks.sequence_shard`` from outside
    (``omniloop.parallel.sequence``): the stack then runs on this rank's share of the tokens.
    """
    shard = getattr(blocks, "sequence_shard", None)
    if shard is not None:
        return shard.run(blocks, hidden, args, kwargs, interceptor)
    return run_block_stack(blocks, hidden, *args, interceptor=interceptor, **kwargs)


def run_block_stack(
    blocks: BlockStack,
    hidden: torch.Tensor,
    *args: Any,
    interceptor: BlockInterceptor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The block loop itself (``run_blocks`` without the sequence-parallel seam)."""
    if interceptor is None:
        for block in blocks:
            hidden = block(hidden, *args, **kwargs)
        return hidden
    return interceptor.run(blocks, hidden, BlockCall(blocks, args, kwargs, hidden.shape[0]))
