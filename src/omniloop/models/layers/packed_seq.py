"""``PackedSeq``: one token sequence packing the modality segments of one or more samples.

A mixture-of-transformers model (Cosmos3, BAGEL, Transfusion-lineage) runs one sequence
per forward in which each sample contributes segments in order, e.g. Cosmos3's
``[text (causal) | vision patches | sound | action]``. A ``PackedSeq`` records, per
segment, its modality, the pathway whose weights process it (``und``: understanding,
``gen``: generation), its attention mode and its token grid; the samples' offsets; and the
3D-MRoPE position planes of every token. It replaces order-sensitive flat-index slicing:
``seq.index(modality="vision")`` says where the vision tokens are.

Attention modes (what a query of the segment sees, always within its own sample):

* ``causal``   -- the causal segments of the sample up to and including itself (text);
* ``full``     -- every token of the sample (Cosmos3's generated modalities);
* ``temporal_causal`` -- the sample's causal segments, and the tokens of its own segment in
  frames up to its own (world-model rollouts: a frame never sees the future).

Attention over a ``PackedSeq`` goes through the backend registry two ways with the same
meaning: :func:`packed_attention` runs one kernel call per (sample, mode) group with no
mask where the group allows it (causal flag, or full; bit-identical to separate per-sample
calls), and :meth:`PackedSeq.block_mask` gives the ``[N, N]`` mask for one masked call.

Position planes (3D-MRoPE; see ``omniloop.models.layers.mrope``): text tokens count up
in all three planes; a vision grid takes ``(t, h, w)`` with the temporal plane optionally
modulated by FPS (``t * base_fps / fps`` in latent-frame units) so clips of different frame
rates share one time axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Sequence

import torch

from omniloop.models.layers.attention import attention

UND, GEN = "und", "gen"


class AttnMode(str, Enum):
    CAUSAL = "causal"
    FULL = "full"
    TEMPORAL_CAUSAL = "temporal_causal"


@dataclass(frozen=True)
class Segment:
    """A run of tokens of one modality of one sample, in ``grid`` order (t-major)."""

    modality: str  # "text", "vision", "sound", "action", ...
    pathway: str  # UND or GEN: whose weights process these tokens
    mode: AttnMode
    start: int  # offset in the packed sequence
    grid: tuple[int, int, int]  # (T, H, W) tokens; a text run is (L, 1, 1)
    sample: int = 0

    def __post_init__(self) -> None:
        assert all(g >= 1 for g in self.grid), f"segment grid {self.grid} must be positive"
        assert self.start >= 0, f"segment start {self.start} must be >= 0"

    @property
    def length(self) -> int:
        return math.prod(self.grid)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]


@dataclass(frozen=True)
class PackedSeq:
    segments: tuple[Segment, ...]
    positions: torch.Tensor  # [3, N] float32 MRoPE planes (t, h, w)
    num_samples: int = 1
    offsets: tuple[int, ...] = field(init=False)  # [num_samples + 1] sample boundaries

    def __post_init__(self) -> None:
        segs = tuple(sorted(self.segments, key=lambda s: s.start))
        object.__setattr__(self, "segments", segs)
        end = 0
        bounds = [0]
        for i, s in enumerate(segs):
            assert s.start == end, f"segments must tile the sequence: segment {i} starts at {s.start}, expected {end}"
            end = s.end
            assert 0 <= s.sample < self.num_samples, f"segment sample {s.sample} outside [0, {self.num_samples})"
            if i and s.sample != segs[i - 1].sample:
                assert s.sample == segs[i - 1].sample + 1, "samples must be contiguous and in order"
                bounds.append(s.start)
        bounds.append(end)
        assert len(bounds) == self.num_samples + 1, f"{self.num_samples} samples but {len(bounds) - 1} sample runs"
        assert self.positions.shape == (3, end), f"positions {tuple(self.positions.shape)} != (3, {end})"
        object.__setattr__(self, "offsets", tuple(bounds))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    # -- views ------------------------------------------------------------------------
    def select(self, *, sample: int | None = None, modality: str | None = None, pathway: str | None = None,
               mode: AttnMode | None = None) -> list[Segment]:
        return [s for s in self.segments if (sample is None or s.sample == sample)
                and (modality is None or s.modality == modality) and (pathway is None or s.pathway == pathway)
                and (mode is None or s.mode == mode)]

    def index(self, device: torch.device | str | None = None, **match) -> torch.Tensor:
        """``[n]`` int64 positions in the sequence of the matching segments' tokens, in order."""
        parts = [torch.arange(s.start, s.end, device=device) for s in self.select(**match)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)

    def sample_range(self, sample: int) -> tuple[int, int]:
        return self.offsets[sample], self.offsets[sample + 1]

    # -- packing ------------------------------------------------------------------------
    @staticmethod
    def concat(seqs: Sequence["PackedSeq"]) -> "PackedSeq":
        """Pack several sequences into one (their samples renumbered in order)."""
        segments: list[Segment] = []
        shift, sample_shift = 0, 0
        for seq in seqs:
            segments += [replace(s, start=s.start + shift, sample=s.sample + sample_shift) for s in seq.segments]
            shift += seq.num_tokens
            sample_shift += seq.num_samples
        return PackedSeq(tuple(segments), torch.cat([s.positions for s in seqs], dim=1), num_samples=sample_shift)

    # -- attention structure ------------------------------------------------------------
    def block_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[N, N]`` bool, True = query row may attend key column (the modes above)."""
        n = self.num_tokens
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)
        for b in range(self.num_samples):
            lo, hi = self.sample_range(b)
            causal_idx = self.index(device, sample=b, mode=AttnMode.CAUSAL)
            for s in self.select(sample=b):
                rows = slice(s.start, s.end)
                if s.mode is AttnMode.FULL:
                    mask[rows, lo:hi] = True
                    continue
                mask[rows, causal_idx] = True  # the causal context (text) of the sample
                if s.mode is AttnMode.CAUSAL:
                    q_pos = torch.arange(s.start, s.end, device=device)
                    mask[rows, causal_idx] &= (causal_idx[None, :] <= q_pos[:, None])
                else:  # temporal causal: own segment, frames <= the query's frame
                    f = torch.arange(s.length, device=device) // s.tokens_per_frame
                    mask[rows, s.start:s.end] = f[None, :] <= f[:, None]
        return mask


# -- builders ---------------------------------------------------------------------------


@dataclass
class SampleBuilder:
    """Builds the segments and positions of one sample, segment by segment."""

    segments: list[Segment] = field(default_factory=list)
    planes: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def add(self, modality: str, pathway: str, mode: AttnMode, grid: tuple[int, int, int],
            positions: torch.Tensor) -> Segment:
        seg = Segment(modality=modality, pathway=pathway, mode=mode, start=self.length, grid=tuple(grid))  # type: ignore[arg-type]
        assert positions.shape == (3, seg.length), f"{modality} positions {tuple(positions.shape)} != (3, {seg.length})"
        self.segments.append(seg)
        self.planes.append(positions.float())
        self.length += seg.length
        return seg

    def build(self) -> PackedSeq:
        positions = torch.cat(self.planes, dim=1) if self.planes else torch.zeros(3, 0)
        return PackedSeq(tuple(self.segments), positions)


def text_positions(num_tokens: int, offset: float) -> tuple[torch.Tensor, float]:
    """``[3, n]`` planes counting up from ``offset`` in all three planes, and the next offset."""
    ids = torch.arange(num_tokens, dtype=torch.float32) + offset
    return ids.unsqueeze(0).expand(3, -1).contiguous(), offset + num_tokens


def grid_positions(
    grid: tuple[int, int, int],
    offset: float,
    *,
    fps: float | None = None,
    base_fps: float = 24.0,
    frames_per_token: int = 4,
    base_frames_per_token: int | None = None,
    start_frame: int = 0,
    reset_spatial: bool = True,
) -> tuple[torch.Tensor, int]:
    """``[3, T*H*W]`` planes of a token grid (t-major) starting at temporal ``offset``, and the
    next free temporal offset (``ceil(max) + 1``).

    FPS modulation (``fps`` given and ``T > 1``): token frame ``i`` sits at
    ``(i + start_frame) / (fps / frames_per_token) * (base_fps / base_frames_per_token) + offset``,
    i.e. in units of the base rate's latent frames. ``reset_spatial=False`` offsets the h/w
    planes by ``offset`` too. (Cosmos3's ``get_3d_mrope_ids_vae_tokens``.)
    """
    t, h, w = grid
    base_fpt = frames_per_token if base_frames_per_token is None else base_frames_per_token
    if fps is not None and t > 1:
        tps, base_tps = fps / frames_per_token, base_fps / base_fpt
        frames = torch.arange(t, dtype=torch.float32)
        t_plane = ((frames + start_frame) / tps * base_tps + offset).view(-1, 1).expand(-1, h * w).flatten()
    else:
        t_plane = (torch.arange(t, dtype=torch.long).view(-1, 1).expand(-1, h * w).flatten() + int(offset)
                   + start_frame).float()
    h_plane = torch.arange(h, dtype=torch.long).view(1, -1, 1).expand(t, -1, w).flatten()
    w_plane = torch.arange(w, dtype=torch.long).view(1, 1, -1).expand(t, h, -1).flatten()
    if not reset_spatial:
        h_plane, w_plane = h_plane + int(offset), w_plane + int(offset)
    planes = torch.stack([t_plane, h_plane.float(), w_plane.float()])
    return planes, math.ceil(planes.max().item()) + 1


# -- attention ----------------------------------------------------------------------------


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PackedSeq, backend: str = "sdpa"
) -> torch.Tensor:
    """``q [N, H, D], k/v [N, H_kv, D]`` over ``seq`` -> ``[N, H, D]``.

    One backend call per (sample, mode) group of query segments: causal segments attend the
    sample's causal tokens with the causal flag, full segments every token of the sample,
    unmasked; temporal-causal segments take a mask. Each sample's result is what attending
    it alone gives, bit for bit (no padding, no mask where none is needed).
    """
    out = torch.empty_like(q)
    for b in range(seq.num_samples):
        lo, hi = seq.sample_range(b)
        causal_idx = seq.index(q.device, sample=b, mode=AttnMode.CAUSAL)
        for mode in AttnMode:
            segs = seq.select(sample=b, mode=mode)
            if not segs:
                continue
            rows = torch.cat([torch.arange(s.start, s.end, device=q.device) for s in segs])
            qg = q.index_select(0, rows)[None]  # [1, n, H, D]
            if mode is AttnMode.FULL:
                o = attention(qg, k[None, lo:hi], v[None, lo:hi], backend)
            elif mode is AttnMode.CAUSAL:
                # causal rows are the sample's causal tokens themselves (queries == keys)
                assert torch.equal(rows, causal_idx), "causal segments must be the sample's causal context"
                o = attention(qg, k.index_select(0, rows)[None], v.index_select(0, rows)[None], backend, causal=True)
            else:  # temporal causal: the sample's keys under the block mask
                mask = seq.block_mask(q.device)[rows][:, lo:hi]
                o = attention(qg, k[None, lo:hi], v[None, lo:hi], backend, mask=mask[None, None])
            out[rows] = o[0]
    return out

