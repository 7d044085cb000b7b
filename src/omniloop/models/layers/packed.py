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
        return per_sample.index_select(0, self.owners(per_sample.device))

    def owners(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[N]`` int64: the segment each token belongs to. Built on the CPU and copied once per
        device (cached): NOTE a device tensor made from a Python list per call would be a
        blocking host-to-device copy in every block of a packed forward."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_owners", {})
        if device not in cache:
            cpu = torch.repeat_interleave(torch.arange(self.count), torch.tensor(self.lengths))
            cache[device] = cpu if device.type == "cpu" else _to_device(cpu, device)
        return cache[device]

    def cu_seqlens(self, device: torch.device | str) -> torch.Tensor:
        """``offsets`` as int32 on ``device`` (varlen kernels), cached like :meth:`owners`."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_cu_seqlens", {})
        if device not in cache:
            cache[device] = _to_device(torch.tensor(self.offsets, dtype=torch.int32), device)
        return cache[device]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[N, ...]`` -> one ``[n_s, ...]`` view per segment."""
        return list(x.split(list(self.lengths)))

    def narrow_tokens(self, start: int, size: int) -> "TokenWindow":
        """Tokens ``start..start+size-1`` of the packed sequence (one rank's shard of it under
        sequence parallelism, ``omniloop.parallel.sequence``): see :class:`TokenWindow`."""
        assert 0 <= start and start + size <= self.total, f"window {start}+{size} outside {self.total} tokens"
        return TokenWindow(self, start, size)


@dataclass(frozen=True)
class TokenWindow:
    """A contiguous window of a packed sequence's tokens, which may cut through samples.

    Per-token ops see only the window: :meth:`expand` gives each of its ``size`` tokens its
    sample's vector. Attention needs every token of a sample, so ``varlen_attention`` hands a
    window to a backend that gathers the whole sequence first (a sequence-parallel one,
    ``attention.register_window_attention``) and refuses it to any other."""

    full: Segments
    start: int
    size: int

    @property
    def count(self) -> int:
        return self.full.count

    @property
    def total(self) -> int:
        return self.size

    def expand(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[S, *F]`` -> ``[size, *F]``: the window's rows of ``full.expand(per_sample)``."""
        assert per_sample.shape[0] == self.full.count, f"{per_sample.shape[0]} vectors for {self.full.count} segments"
        if self.full.count == 1:
            return per_sample.expand(self.size, *per_sample.shape[1:])
        owners = self.full.owners(per_sample.device).narrow(0, self.start, self.size)
        return per_sample.index_select(0, owners)


def interleave_index(first: Segments, second: Segments, device: torch.device) -> torch.Tensor:
    """Index into ``cat([a, b])`` (``a`` packed by ``first``, ``b`` by ``second``, one segment
    per sample in both) that orders tokens sample by sample: ``[a_0, b_0, a_1, b_1, ...]``
    (Flux's joint sequence: each sample's text tokens, then its image tokens). Cached on
    ``first`` per (second, device), like ``Segments.owners``: NOTE a forward captured into a
    CUDA graph (layers/cuda_graphs.py) must find it built, since a host-to-device copy cannot
    be captured."""
    device = torch.device(device)
    cache = first.__dict__.setdefault("_interleave", {})
    if (second, device) not in cache:
        cache[(second, device)] = _interleave(first, second, device)
    return cache[(second, device)]


def _interleave(first: Segments, second: Segments, device: torch.device) -> torch.Tensor:
    assert first.count == second.count, f"{first.count} vs {second.count} samples"
    parts = []
    for s in range(first.count):
        a0, a1 = first.offsets[s], first.offsets[s + 1]
        b0, b1 = second.offsets[s], second.offsets[s + 1]
        parts += [torch.arange(a0, a1), first.total + torch.arange(b0, b1)]
    index = torch.cat(parts)
    return index if torch.device(device).type == "cpu" else _to_device(index, torch.device(device))


def _to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small index tensor to ``device`` without blocking the host (pinned, async copy)."""
    if device.type == "cuda":
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def joint_segments(first: Segments, second: Segments) -> Segments:
    return Segments(tuple(a + b for a, b in zip(first.lengths, second.lengths)))
