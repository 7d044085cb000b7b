"""3D multimodal rotary embeddings (MRoPE, Qwen3-VL / Cosmos3 layout).

A token's position is three planes ``(t, h, w)`` (``positions [3, ..., N]``, float32: the
temporal plane may be fractional under FPS modulation). Each plane drives its own slice of
the rotary frequencies, interleaved ``[t h w t h w ... t t]``: frequency ``i`` takes plane
``h`` when ``i % 3 == 1 and i < 3 * sections[1]``, plane ``w`` when ``i % 3 == 2 and
i < 3 * sections[2]``, plane ``t`` otherwise (Qwen3-VL's interleaved MRoPE). Text tokens
carry the same value in all three planes, which makes this the plain 1D RoPE.

Vocabulary: ``sections = (s_t, s_h, s_w)`` sums to ``head_dim // 2`` (frequencies per
plane before interleaving); ``theta`` is the RoPE base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def inv_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies ``theta ** (-2i / head_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def mrope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, sections: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [3, *batch, N]`` -> ``cos, sin [*batch, N, head_dim]`` (fp32 angles, cast to ``dtype``).

    NOTE: the angles are computed in float32 whatever ``dtype`` is: bfloat16 cannot hold
    consecutive integers past 256, and positions start past 15,000 for vision tokens.
    """
    assert positions.shape[0] == 3, f"positions must be [3, ..., N] (t, h, w planes), got {tuple(positions.shape)}"
    assert sum(sections) == head_dim // 2, f"mRoPE sections {list(sections)} must sum to head_dim // 2 = {head_dim // 2}"
    inv = inv_frequencies(head_dim, theta, positions.device)  # [D/2]
    freqs = positions.float()[..., None] * inv  # [3, *batch, N, D/2]
    out = freqs[0].clone()
    for plane, offset in ((1, 1), (2, 2)):
        idx = slice(offset, sections[plane] * 3, 3)
        out[..., idx] = freqs[plane][..., idx]
    emb = torch.cat((out, out), dim=-1)  # [*batch, N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass(frozen=True)
class Rotary:
    """Rotary tables built once per forward and shared by every layer: ``cos [..., L, 1, D]``
    and ``sin [..., L, 1, D]`` with its first half negated, so that a layer's rotation is
    ``x * cos + x.roll(D/2) * sin`` (4 ops instead of 9; bit-equal to :func:`apply_rotary`:
    ``roll`` gives ``[x2, x1]`` and a negation is exact)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> "Rotary":
        """From ``cos, sin [..., L, D]`` (``mrope_cos_sin``'s output)."""
        half = cos.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cls(cos.unsqueeze(-2), signed.unsqueeze(-2))

    def select(self, rows: torch.Tensor) -> "Rotary":
        """The tables of token ``rows`` (a packed sequence's ``[N]`` tables)."""
        return Rotary(self.cos[rows], self.sin[rows])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., L, H, D]`` -> rotated, like ``apply_rotary(x, cos, sin)``."""
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [..., L, H, D]`` with ``cos, sin [..., L, D]`` (broadcast over heads)."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)
