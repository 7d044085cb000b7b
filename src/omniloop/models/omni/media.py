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

from omniloop.models.layers.qwen2_decoder import KVCacheView
from omniloop.models.omni.image_prompt import VisionRun
from omniloop.pipeline.loops.ar import PromptTokens


@dataclass(frozen=True)
class PromptRope:
    """A prompt's multimodal rotary positions (transformers' ``get_rope_index``), read by the
    thinker and, for a spoken answer, the talker: its prompt is the thinker's conversation
    followed by text positions, so transformers' talker derives the same planes and delta."""

    positions: torch.Tensor  # [3, P] long: the prompt's t / h / w planes
    delta: int  # a position past the prompt: its context index + delta on every plane

    @property
    def prompt_len(self) -> int:
        return int(self.positions.shape[1])

    def at(self, k: torch.Tensor) -> torch.Tensor:
        """``k [L]`` context indices -> ``[3, L]`` rotary positions."""
        inside = k.clamp(max=self.prompt_len - 1)
        return torch.where(k < self.prompt_len, self.positions[:, inside], (k + self.delta).expand(3, -1))


def kv_positions(ids: torch.Tensor, kv: KVCacheView | None) -> torch.Tensor:
    """A forward's text positions ``[B, L]``: the KV view's, or ``0 .. L-1`` without a cache."""
    b, n = ids.shape
    return kv.positions if kv is not None else torch.arange(n, device=ids.device).expand(b, n)


def mixed_rope(positions: torch.Tensor, ropes: Sequence[PromptRope | None],
               starts: Sequence[int] | None = None) -> torch.Tensor:
    """``positions [B, L]`` context indices -> ``[B, L]`` as they are when no row has 3-D positions,
    else ``[3, B, L]`` (a row without them: its index on every plane). ``starts``: each row's
    first position on the host; when every 3-D row is past its prompt (a decode step) the planes
    are ``positions + delta`` for the whole batch at once instead of row by row."""
    if not any(r is not None for r in ropes):
        return positions
    if starts is not None and (delta := decode_rope_deltas(starts, ropes, positions.device)) is not None:
        return delta_planes(positions, delta)
    return torch.stack([p[None].expand(3, -1) if r is None else r.at(p) for p, r in zip(positions, ropes)], dim=1)


def decode_rope_deltas(starts: Sequence[int], ropes: Sequence[PromptRope | None],
                       device: torch.device) -> torch.Tensor | None:
    """A decode step's rotary offsets for a captured graph (``pipeline/loops/ar_graphs.py``):
    ``[B]`` long, ``delta`` of a row with 3-D positions, 0 for the others, so every plane is
    ``position + delta`` (what :func:`mixed_rope` gives a decode step); None when a row with 3-D
    positions is not past its prompt (its planes come from the prompt's table: eager)."""
    if any(r is not None and s < r.prompt_len for s, r in zip(starts, ropes)):
        return None
    return torch.tensor([0 if r is None else r.delta for r in ropes], device=device)


def delta_planes(positions: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``positions [B, L]`` + ``deltas [B]`` -> the ``[3, B, L]`` planes of a decode step."""
    return (positions + deltas[:, None])[None].expand(3, -1, -1)


@dataclass(kw_only=True)
class MediaEmbeds:
    """The encoder outputs of one prompt (per request; never on a shared module)."""

    index: torch.Tensor  # [P] long on the device: row of ``embeds`` at a placeholder position, -1 elsewhere
    embeds: torch.Tensor  # [N, D] the thinker's dtype, on its device
    positions: torch.Tensor | None = None  # [3, P] long: multimodal rotary positions (images); None: 1-D
    delta: int = 0  # a position past the prompt: its context index + delta on every plane
    # Qwen3-Omni's images: the vision encoder's DeepStack features of every row (zeros at other
    # encoders' rows), added to the thinker's hidden states after its first layers at image positions
    deepstack: torch.Tensor | None = None  # [layers, N, D]
    visual: torch.Tensor | None = None  # [N] bool: rows an image made (where DeepStack adds)
    runs: tuple[VisionRun, ...] = ()  # the prompt's image runs in order (a talker re-derives its positions)

    @property
    def rope(self) -> PromptRope | None:
        """The prompt's 3-D positions (an image or a video in it), else None (1-D)."""
        return None if self.positions is None else PromptRope(self.positions, self.delta)

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

    def add_deepstack(self, h: torch.Tensor, start: int, layer: int) -> torch.Tensor:
        """``h [L, D]``: one row's hidden states after ``layer`` at positions ``start ..`` -> with that
        layer's DeepStack features added at the image positions (transformers' ``_deepstack_process``)."""
        if self.deepstack is None or self.visual is None or layer >= self.deepstack.shape[0] or start >= self.prompt_len:
            return h
        stop = min(start + h.shape[0], self.prompt_len)
        rows = torch.full((h.shape[0],), -1, dtype=torch.long, device=h.device)
        rows[: stop - start] = self.index[start:stop]
        picked = rows.clamp(min=0)
        added = (rows >= 0) & self.visual[picked]  # [L]
        return torch.where(added[:, None], h + self.deepstack[layer][picked].to(h.dtype), h)

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
    if any(m is not None and s < m.prompt_len for m, s in zip(media, starts)):  # a row forwards prompt positions
        embeds = torch.stack([e if m is None else m.merge(e, s) for e, m, s in zip(embeds, media, starts)])
    return embeds, mixed_rope(positions, [None if m is None else m.rope for m in media], starts)


def media_embeds(ids: Sequence[int], runs: dict[int, list[torch.Tensor]], device: torch.device) -> MediaEmbeds:
    """``ids`` (placeholders expanded) + each placeholder token's embeddings in prompt order ->
    one table whose rows follow the prompt (``index[p]``: the row at position ``p``)."""
    order = {token: iter(torch.cat(embeds)) for token, embeds in runs.items() if embeds}
    rows: list[torch.Tensor] = []
    index: list[int] = []
    for t in ids:
        if t in order:
            index.append(len(rows))
            rows.append(next(order[t]))
        else:
            index.append(-1)
    return MediaEmbeds(index=torch.tensor(index, device=device), embeds=torch.stack(rows))
