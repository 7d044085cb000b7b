"""FARDiT against diffusers' AnyFlowFARTransformer3DModel on a tiny random checkpoint saved
with diffusers: chunk by chunk, each chunk's denoise forward reads the K/V our clean-context
passes wrote into slabs, where diffusers re-encodes every earlier chunk into its buffers.

Measured (fp32, CPU): max |ours - diffusers| = 4.8e-7 on velocities up to 2.6, on every one of
4 chunks (float rounding: flex attention vs SDPA, and our incremental K/V); asserted <= 1e-5.
Without diffusers' zero-key padding (see model.py) the first chunk is off by 0.17.
"""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.cache.chunk_kv import ChunkKVBatch, ChunkKVHandle, ChunkKVPool
from omniloop.models.families.far.stages import FARChunks
from omniloop.models.families.far.weights import far_state_dict_from_diffusers, load_far_dit
from omniloop.pipeline.loops.chunk import ChunkPlan
from tests.models.far.checkpoint import tiny_far_transformer

TOL = 1e-5
CHUNKS = (1, 2, 2, 2)  # with full_chunk_limit 3: two chunks in the full window, then compression
B, C, H, W = 2, 16, 8, 8  # two rows: a CFG pair's KV is per row


def _diffusers_kv_cache(ref, partition):
    cfg = ref.config
    full_tpf, comp_tpf = (H // 2) * (W // 2), (H // 4) * (W // 4)
    full = cfg.full_chunk_limit * max(partition) * full_tpf
    comp = (len(partition) - cfg.full_chunk_limit + 1) * max(partition) * comp_tpf
    return {i: {"full_cache": torch.zeros(2, B, cfg.num_attention_heads, full, cfg.attention_head_dim),
                "compressed_cache": torch.zeros(2, B, cfg.num_attention_heads, comp, cfg.attention_head_dim)}
            for i in range(cfg.num_layers)}


def _layouts(model, plan):
    chunks = FARChunks(full_chunk_limit=model.config.full_chunk_limit)

    class _Ctx:
        def component(self, name):
            return model

    return chunks, *chunks.kv_tiers(_Ctx(), None, plan)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ref = tiny_far_transformer(full_chunk_limit=3, chunk_partition=CHUNKS)
    folder = tmp_path_factory.mktemp("far_dit")
    ref.save_pretrained(folder)
    return ref, load_far_dit(folder, device="cpu", dtype=torch.float32)


def test_state_dict_maps_every_key(models):
    ref, ours = models
    mapped = far_state_dict_from_diffusers(ref.state_dict())
    assert set(mapped) == set(ours.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(mapped[key], value), key


@torch.inference_mode()
def test_chunked_rollout_forwards_match_diffusers(models):
    ref, ours = models
    partition = list(CHUNKS)
    gen = torch.Generator().manual_seed(0)
    frames = sum(partition)
    text = torch.randn(B, 7, ref.config.text_dim, generator=gen)
    clean = torch.randn(B, C, frames, H, W, generator=gen)  # what the chunks denoise to
    noisy = torch.randn(B, C, frames, H, W, generator=gen)

    plan = ChunkPlan(partition=tuple(partition), context_chunks=0, shape=(1, C, frames, H, W))
    chunks, layouts, policies = _layouts(ours, plan)
    pool = ChunkKVPool(1 << 26, "cpu")
    handle = ChunkKVHandle(pool, layouts, policies, ("uncond", "cond"))
    rows = [(handle, "uncond"), (handle, "cond")]
    kv_cache, flag = _diffusers_kv_cache(ref, partition), {"num_cached_chunks": 0, "is_cache_step": False}

    for c in range(len(partition)):
        start, stop = plan.frames(c)
        t = torch.tensor([700.0 - 100 * c], dtype=torch.float64).expand(B, stop - start)
        r = t - 350.0
        want, _ = ref(hidden_states=noisy[:, :, start:stop].permute(0, 2, 1, 3, 4), timestep=t, r_timestep=r,
                      encoder_hidden_states=text, chunk_partition=partition[: c + 1], kv_cache=kv_cache,
                      kv_cache_flag=copy.deepcopy(flag), return_dict=False)
        cached, own = chunks.denoise_segments(plan, c)
        got = ours(noisy[:, :, start:stop], t, r, text, kv=ChunkKVBatch(rows, cached, (own,), write=False))
        err = (got - want.permute(0, 2, 1, 3, 4)).abs().max().item()
        assert err <= TOL, (c, err)
        if c == len(partition) - 1:
            break
        # the boundary: diffusers re-encodes chunks 0..c; ours writes what changed
        flag["is_cache_step"] = True
        zeros = torch.zeros(B, stop, dtype=torch.long)
        mask = ref.build_attention_mask(chunk_partition=partition[: c + 1], height=H, width=W, mode="cache")
        ref(hidden_states=clean[:, :, :stop].permute(0, 2, 1, 3, 4), chunk_partition=partition[: c + 1],
            timestep=zeros, r_timestep=zeros, encoder_hidden_states=text, attention_mask=mask, kv_cache=kv_cache,
            kv_cache_flag=copy.deepcopy(flag), return_dict=False)
        flag["num_cached_chunks"] += 1
        flag["is_cache_step"] = False
        cached, new = chunks.context_segments(plan, c)
        x = torch.cat([clean[:, :, s.start : s.start + s.frames] for s in new], dim=2)
        zeros64 = torch.zeros(B, x.shape[2], dtype=torch.float64)
        assert ours(x, zeros64, zeros64, text, kv=ChunkKVBatch(rows, cached, new, write=True)) is None
        handle.retire(c)
    # the full window holds the last two finished chunks, the compressed tier the older one
    assert handle.chunks("full") == [1, 2] and handle.chunks("compressed") == [0]
