"""Packed token sequences: samples of different lengths laid end to end in one ``[N, ...]``
tensor (no batch dim, no padding), described by their :class:`Segments`.

A packed forward runs every per-token op (linears, norms, MLPs) once over all ``N`` tokens
and attention per segment (``attention.varlen_attention``), so requests of different
sizes share one forward; per-sample vectors (timestep / adaLN modulation) reach their
tokens through :meth:`Segments.expand`. Same-length segments take the broadcast path
(``[S, L, ...]`` views), which is the batched forward's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Segments:
    lengths: tuple[int, ...]  # tokens of each sample, in packing order

    def __post_init__(self) -> None:
        assert self.lengths and all(n > 0 for n in self.lengths), f"segments need positive lengths, got {self.lengths}"

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each segment, plus the total at the end (``cu_seqlens``)."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    def slices(self) -> list[slice]:
        return [slice(a, b) for a, b in zip(self.offsets, self.offsets[1:])]

    def expand(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[S, *F]`` -> ``[N, *F]``: each sample's vector repeated over its tokens."""
        assert per_sample.shape[0] == self.count, f"{per_sample.shape[0]} vectors for {self.count} segments"
        if self.count == 1:
            return per_sample.expand(self.total, *per_sample.shape[1:])
        if self.uniform:
            n = self.lengths[0]
            return per_sample[:, None].expand(self.count, n, *per_sample.shape[1:]).reshape(self.total, *per_sample.shape[1:])
        lengths = torch.tensor(self.lengths, device=per_sample.device)
        return per_sample.repeat_interleave(lengths, dim=0, output_size=self.total)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[N, ...]`` -> one ``[n_s, ...]`` view per segment."""
        return list(x.split(list(self.lengths)))


def interleave_index(first: Segments, second: Segments, device: torch.device) -> torch.Tensor:
    """Index into ``cat([a, b])`` (``a`` packed by ``first``, ``b`` by ``second``, one segment
    per sample in both) that orders tokens sample by sample: ``[a_0, b_0, a_1, b_1, ...]``
    (Flux's joint sequence: each sample's text tokens, then its image tokens)."""
    assert first.count == second.count, f"{first.count} vs {second.count} samples"
    parts = []
    for s in range(first.count):
        a0, a1 = first.offsets[s], first.offsets[s + 1]
        b0, b1 = second.offsets[s], second.offsets[s + 1]
        parts += [torch.arange(a0, a1), first.total + torch.arange(b0, b1)]
    return torch.cat(parts).to(device)


def joint_segments(first: Segments, second: Segments) -> Segments:
    return Segments(tuple(a + b for a, b in zip(first.lengths, second.lengths)))
