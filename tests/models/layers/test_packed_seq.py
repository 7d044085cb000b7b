"""PackedSeq: segment masks, 3D-MRoPE planes (vs diffusers' Cosmos3 builders), packed
attention (grouped, unmasked calls) == one masked call == separate per-sample calls."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.layers.attention import attention
from omniloop.models.layers.packed_seq import (
    GEN, UND, AttnMode, PackedSeq, SampleBuilder, grid_positions, packed_attention, text_positions,
)


def _sample(text: int, grid: tuple[int, int, int], mode: AttnMode = AttnMode.FULL, extra: int = 0) -> PackedSeq:
    b = SampleBuilder()
    planes, nxt = text_positions(text, 0)
    b.add("text", UND, AttnMode.CAUSAL, (text, 1, 1), planes)
    planes, _ = grid_positions(grid, nxt + 100, fps=12.0)
    b.add("vision", GEN, mode, grid, planes)
    if extra:
        planes, _ = grid_positions((extra, 1, 1), nxt + 100, fps=25.0, frames_per_token=1)
        b.add("sound", GEN, AttnMode.FULL, (extra, 1, 1), planes)
    return b.build()


def test_block_mask_modes():
    seq = PackedSeq.concat([_sample(3, (2, 1, 2)), _sample(2, (2, 1, 1), AttnMode.TEMPORAL_CAUSAL)])
    m = seq.block_mask()
    assert seq.offsets == (0, 7, 11) and seq.num_samples == 2
    # sample 0: text causal over text only; vision sees the whole sample, nothing of sample 1
    assert m[0, :7].tolist() == [True, False, False, False, False, False, False]
    assert m[2, :3].all() and not m[2, 3:].any()
    assert m[3:7, :7].all() and not m[3:7, 7:].any()
    # sample 1: temporal-causal vision frame 0 sees the text and frame 0, frame 1 sees both frames
    assert m[9].tolist()[7:] == [True, True, True, False]
    assert m[10].tolist()[7:] == [True, True, True, True]
    assert not m[7:, :7].any()
    assert seq.index(modality="vision").tolist() == [3, 4, 5, 6, 9, 10]
    assert seq.index(pathway=UND, sample=1).tolist() == [7, 8]


def test_positions_match_diffusers_cosmos3_builders():
    pipe = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")
    ids, nxt = pipe.get_3d_mrope_ids_text_tokens(7, 0, use_float_positions=True)
    ours, our_next = text_positions(7, 0)
    assert torch.equal(ours, ids.float()) and our_next == nxt
    for kwargs in (dict(fps=24.0), dict(fps=None), dict(fps=10.0, reset_spatial_indices=False),
                   dict(fps=24.0, temporal_compression_factor=1, base_temporal_compression_factor=4, start_frame_offset=1)):
        theirs, t_next = pipe.get_3d_mrope_ids_vae_tokens(3, 2, 4, temporal_offset=15007, **kwargs)
        mine, m_next = grid_positions(
            (3, 2, 4), 15007, fps=kwargs.get("fps"), frames_per_token=kwargs.get("temporal_compression_factor", 4),
            base_frames_per_token=kwargs.get("base_temporal_compression_factor"),
            start_frame=kwargs.get("start_frame_offset", 0), reset_spatial=kwargs.get("reset_spatial_indices", True))
        assert torch.equal(mine, theirs.float()), kwargs
        assert m_next == t_next


def test_packed_attention_equals_per_sample_calls_and_the_block_mask():
    g = torch.Generator().manual_seed(0)
    seqs = [_sample(5, (2, 2, 2), extra=3), _sample(3, (1, 2, 3)), _sample(4, (3, 1, 2), AttnMode.TEMPORAL_CAUSAL)]
    seq = PackedSeq.concat(seqs)
    n = seq.num_tokens
    q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    out = packed_attention(q, k, v, seq)
    # bit-equal to each sample attended alone, the way Cosmos3 does it (text causal, gen over all)
    lo, hi = seq.sample_range(0)
    t = 5
    alone_text = attention(q[None, :t], k[None, :t], v[None, :t], causal=True)[0]
    alone_gen = attention(q[None, t:hi], k[None, lo:hi], v[None, lo:hi])[0]
    assert torch.equal(out[:t], alone_text) and torch.equal(out[t:hi], alone_gen)
    # one masked call over the whole packed sequence: the same attention
    masked = attention(q[None], k[None], v[None], "math", mask=seq.block_mask()[None, None])[0]
    torch.testing.assert_close(out, masked, rtol=1e-5, atol=1e-6)


def test_segments_must_tile():
    with pytest.raises(AssertionError, match="tile"):
        from omniloop.models.layers.packed_seq import Segment

        PackedSeq((Segment("text", UND, AttnMode.CAUSAL, 0, (2, 1, 1)), Segment("vision", GEN, AttnMode.FULL, 3, (1, 1, 1))),
                  torch.zeros(3, 4))
