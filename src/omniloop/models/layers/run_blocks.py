"""``run_blocks``: the one place a DiT iterates its block stack.

Model code calls ``run_blocks(blocks, hidden, **kwargs)`` instead of writing the loop, so
block-level interceptors (cache acceleration: DBCache/FBCache, TaylorSeer) and observers
plug in from outside the model (STYLE.md 8). With no interceptor it is a plain loop.

A :class:`BlockInterceptor` is per-request, per-branch state handed in by the loop for one
forward; it is never stored on the model.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import nn


class BlockInterceptor(Protocol):
    """Runs (or skips) a block stack for one forward.

    ``run(blocks, hidden, call)`` must return the stack's output; ``call(i, hidden)``
    runs block ``i``. An implementation decides which blocks run and substitutes cached
    residuals for the rest.
    """

    def run(self, blocks: Sequence[nn.Module], hidden: torch.Tensor, call: "BlockCall") -> torch.Tensor: ...


class BlockCall(Protocol):
    def __call__(self, index: int, hidden: torch.Tensor) -> torch.Tensor: ...


def run_blocks(
    blocks: Sequence[nn.Module],
    hidden: torch.Tensor,
    *args: Any,
    interceptor: BlockInterceptor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Apply ``blocks`` in order: ``hidden = block(hidden, *args, **kwargs)``."""
    if interceptor is None:
        for block in blocks:
            hidden = block(hidden, *args, **kwargs)
        return hidden

    def call(index: int, h: torch.Tensor) -> torch.Tensor:
        return blocks[index](h, *args, **kwargs)

    return interceptor.run(blocks, hidden, call)
