"""Encoder outputs in the thinker's prompt: one request's media embeddings, addressed by prompt
position, and the prompt artifact that carries them to the thinker loop.

transformers' thinker builds its input embeddings by looking up every prompt id, then
``masked_scatter``-ing the encoder's outputs over the placeholder positions (``<|AUDIO|>``
...) in order. :meth:`MediaEmbeds.merge` does the same per forward row, by position, so a
chunked prefill, a batch of rows and a re-prefill after preemption all see the same inputs.
The values are copies (``torch.where``): bit-equal to the scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omniloop.pipeline.loops.ar import PromptTokens


@dataclass(kw_only=True)
class MediaEmbeds:
    """The encoder outputs of one prompt (per request; never on a shared module)."""

    index: torch.Tensor  # [P] long on the device: row of ``embeds`` at a placeholder position, -1 elsewhere
    embeds: torch.Tensor  # [N, D] the thinker's dtype, on its device
    positions: torch.Tensor | None = None  # [3, P] long: multimodal rotary positions (images); None: 1-D
    delta: int = 0  # a position past the prompt: its context index + delta on every plane

    def rope(self, start: int, length: int) -> torch.Tensor:
        """``[3, length]`` rotary positions of context indices ``start .. start + length``."""
        assert self.positions is not None, "1-D positions: the context index is the position"
        k = torch.arange(start, start + length, device=self.positions.device)
        inside = k.clamp(max=self.prompt_len - 1)
        return torch.where(k < self.prompt_len, self.positions[:, inside], (k + self.delta).expand(3, -1))

    @property
    def prompt_len(self) -> int:
        return int(self.index.numel())

    def mask(self, start: int, end: int) -> torch.Tensor:
        """``[end - start]`` bool: positions whose embedding an encoder made (none past the prompt)."""
        out = torch.zeros(end - start, dtype=torch.bool, device=self.index.device)
        stop = min(end, self.prompt_len)
        if start < stop:
            out[: stop - start] = self.index[start:stop] >= 0
        return out

    def merge(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """``h [L, D]``: the token embeddings of one row at positions ``start .. start + L`` ->
        the same with the placeholder rows replaced by the encoder's embeddings."""
        if start >= self.prompt_len:  # a decode step (or a chunk past the prompt): nothing to merge
            return h
        stop = min(start + h.shape[0], self.prompt_len)
        rows = torch.full((h.shape[0],), -1, dtype=torch.long, device=h.device)
        rows[: stop - start] = self.index[start:stop]
        return torch.where((rows >= 0)[:, None], self.embeds[rows.clamp(min=0)].to(h.dtype), h)


@dataclass(kw_only=True)
class MediaPromptTokens(PromptTokens):
    """The conversation's ids with every placeholder expanded to its encoder's length, and the
    encoder outputs that replace them."""

    lm_inputs: MediaEmbeds


def with_media(embeds: torch.Tensor, positions: torch.Tensor, starts: Sequence[int],
               media: Sequence[MediaEmbeds | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's inputs: ``embeds [B, L, D]`` with each row's encoder embeddings swapped in,
    and its rotary positions: ``positions [B, L]`` (context indices) as they are, or ``[3, B, L]``
    when some row's prompt holds an image (rows without one: their index on every plane)."""
    if not any(m is not None for m in media):
        return embeds, positions
    embeds = torch.stack([e if m is None else m.merge(e, s) for e, m, s in zip(embeds, media, starts)])
    if not any(m is not None and m.positions is not None for m in media):
        return embeds, positions
    rope = [p[None].expand(3, -1) if m is None or m.positions is None else m.rope(s, p.shape[0])
            for p, m, s in zip(positions, media, starts)]
    return embeds, torch.stack(rope, dim=1)
