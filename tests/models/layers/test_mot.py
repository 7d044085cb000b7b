"""MoT layers: the joint packed forward == the per-pathway forwards (text causal over a KV
view, generation tokens over the text K/V + themselves), and packing several samples into
one sequence equals running each alone (up to GEMM rounding: a GEMM's result for a row
depends on how many rows it runs with)."""

from __future__ import annotations

import torch

from omniloop.cache.kv import KVBatch, KVHandle, KVLayout
from omniloop.models.layers.mot import MoTLayer, PathwayConfig
from omniloop.models.layers.mrope import Rotary, mrope_cos_sin
from omniloop.models.layers.packed_seq import GEN, UND, AttnMode, PackedSeq, SampleBuilder, grid_positions, text_positions

CFG = PathwayConfig(hidden_size=16, head_dim=8, num_heads=2, num_kv_heads=1, intermediate_size=24)


def _layer(seed=0, **over):
    torch.manual_seed(seed)
    layer = MoTLayer({UND: CFG, GEN: PathwayConfig(**{**CFG.__dict__, **over})}, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return layer


def _seq(text, grid):
    b = SampleBuilder()
    planes, nxt = text_positions(text, 0)
    b.add("text", UND, AttnMode.CAUSAL, (text, 1, 1), planes)
    planes, _ = grid_positions(grid, nxt + 50, fps=24.0)
    b.add("vision", GEN, AttnMode.FULL, grid, planes)
    return b.build()


class _Context:
    """Read-only text K/V of one sample, then the generation tokens' own (no append)."""

    mask, causal = None, False

    def __init__(self, handle):
        self.handle = handle

    def update(self, layer, k, v):
        kt, vt = self.handle.view(layer)
        return torch.cat([kt[None], k], 1), torch.cat([vt[None], v], 1)


@torch.no_grad()
def test_joint_equals_pathway_forwards_and_packing_equals_alone():
    layer = _layer(act="relu2")
    seqs = [_seq(5, (2, 2, 1)), _seq(3, (1, 1, 3))]
    xs = [torch.randn(s.num_tokens, 16) for s in seqs]
    packed = PackedSeq.concat(seqs)
    cos, sin = mrope_cos_sin(packed.positions, 8, 1e4, (2, 1, 1), torch.float32)
    joint = layer.forward_packed(torch.cat(xs), packed, Rotary.of(cos, sin))
    start = 0
    for seq, x in zip(seqs, xs):
        c, s = mrope_cos_sin(seq.positions, 8, 1e4, (2, 1, 1), torch.float32)
        alone = layer.forward_packed(x, seq, Rotary.of(c, s))
        # packing changes only GEMM row counts (M): equal up to rounding
        torch.testing.assert_close(joint[start:start + seq.num_tokens], alone, rtol=1e-5, atol=1e-5)
        text = seq.index(pathway=UND)
        gen = seq.index(pathway=GEN)
        handle = KVHandle(KVLayout(1, 1, 8), dtype=torch.float32, device="cpu")
        und = layer.forward_pathway(UND, x[None, text], Rotary.of(c[None, text], s[None, text]), KVBatch([handle], len(text)))
        g = layer.forward_pathway(GEN, x[None, gen], Rotary.of(c[None, gen], s[None, gen]), _Context(handle))
        assert torch.equal(und[0], alone[text]) and torch.equal(g[0], alone[gen])
        start += seq.num_tokens


@torch.no_grad()
def test_text_decode_token_by_token_equals_the_prefill():
    layer = _layer()
    x = torch.randn(1, 7, 16)
    planes, _ = text_positions(7, 0)
    cos, sin = mrope_cos_sin(planes, 8, 1e4, (2, 1, 1), torch.float32)
    full = layer.forward_pathway(UND, x, Rotary.of(cos[None], sin[None]), causal=True)
    handle = KVHandle(KVLayout(1, 1, 8), dtype=torch.float32, device="cpu")
    parts = [layer.forward_pathway(UND, x[:, :4], Rotary.of(cos[None, :4], sin[None, :4]), KVBatch([handle], 4))]
    for i in range(4, 7):
        parts.append(layer.forward_pathway(UND, x[:, i:i + 1], Rotary.of(cos[None, i:i + 1], sin[None, i:i + 1]), KVBatch([handle], 1)))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-6)
