"""KVHandle accounting and growth; the causal / masked / GQA attention paths of the registry."""

from __future__ import annotations

import pytest
import torch

from omniloop.cache.kv import KVBatch, KVHandle, KVLayout
from omniloop.models.layers.attention import attention, causal_mask

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)


def test_handle_grows_in_chunks_and_accounts_bytes():
    h = KVHandle(LAYOUT, dtype=torch.float32, device="cpu", chunk_tokens=4)
    assert h.nbytes == 0 and h.num_tokens == 0
    k, v = _kv(6)
    for layer in range(2):
        h.append(layer, k[:3], v[:3])
    assert h.capacity == 4 and h.num_tokens == 3
    assert h.nbytes == 4 * LAYOUT.bytes_per_token(torch.float32) == 4 * 2 * 2 * 2 * 4 * 4
    assert h.used_nbytes == 3 * LAYOUT.bytes_per_token(torch.float32)
    for layer in range(2):
        h.append(layer, k[3:], v[3:])  # crosses the chunk: grows to 8, keeps what was there
    assert h.capacity == 8 and h.num_tokens == 6
    k1, v1 = h.view(1)
    assert torch.equal(k1, k) and torch.equal(v1, v) and k1.is_contiguous()
    h.free()
    h.free()  # idempotent
    assert h.freed and h.nbytes == 0 and h.used_nbytes == 0
    with pytest.raises(AssertionError, match="freed"):
        h.append(0, k, v)


def test_handle_rejects_wrong_shapes_and_layers_out_of_step():
    h = KVHandle(LAYOUT, dtype=torch.float32, device="cpu", reserve_tokens=3)
    assert h.capacity == 256  # reserve rounds up to a chunk
    with pytest.raises(AssertionError, match=r"expects \[T, 2, 4\]"):
        h.append(0, torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    h.append(0, *_kv(1))
    with pytest.raises(AssertionError, match="disagree mid-forward"):
        h.num_tokens


def test_kv_batch_pads_to_the_longest_and_masks_padding():
    handles = [KVHandle(LAYOUT, dtype=torch.float32, device="cpu", chunk_tokens=2) for _ in range(2)]
    for h, n in zip(handles, (3, 1)):
        for layer in range(2):
            h.append(layer, *_kv(n, seed=n))
    batch = KVBatch(handles, 1)
    assert batch.positions.tolist() == [[3], [1]]
    assert batch.mask.shape == (2, 1, 1, 4)
    assert batch.mask[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False]]
    k_new, v_new = torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4)
    k, v = batch.update(0, k_new, v_new)
    assert k.shape == (2, 4, 2, 4) and torch.equal(k[1, 2:], torch.zeros(2, 2, 4))  # padding is zeros
    assert torch.equal(k[1, 1], torch.ones(2, 4)) and torch.equal(k[0, 3], torch.ones(2, 4))
    batch.update(1, k_new, v_new)  # every layer appends before the next forward
    single = KVBatch(handles[:1], 2)
    assert single.mask is None and single.positions.tolist() == [[4, 5]]


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_causal_gqa_and_masked_attention_against_a_reference(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)
    k_rep, v_rep = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)

    def reference(mask):  # [Lq, Lk] or [B, 1, Lq, Lk]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * 8 ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v_rep)

    tri = causal_mask(3, 5, q.device)
    assert tri.tolist()[0] == [True, True, True, False, False]  # bottom-right: query 0 sees the 2-token prefix + itself
    # the backends vs an einsum reference: other kernels, measured <= 4.8e-7
    assert torch.allclose(attention(q, k, v, backend, causal=True), reference(tri), atol=1e-6)
    pad = torch.tensor([True] * 5 + [True, True, True, True, False]).view(2, 1, 1, 5)
    assert torch.allclose(attention(q, k, v, backend, mask=pad), reference(pad), atol=1e-6)
    assert torch.allclose(attention(q, k, v, backend, mask=pad, causal=True), reference(pad & tri), atol=1e-6)
    sq = q[:, :, :2]  # as many query heads as kv heads, no mask: the three-argument DiT path
    plain = torch.einsum("bhqk,bkhd->bqhd", (torch.einsum("bqhd,bkhd->bhqk", sq, k) * 8 ** -0.5).softmax(-1), v)
    assert torch.allclose(attention(sq, k, v, backend), plain, atol=1e-6)


def test_three_argument_backends_still_serve_unmasked_calls():
    from omniloop.models.layers import attention as registry

    calls = []

    @registry.register_attention_backend("test_three_args")
    def _plain(q, k, v):
        calls.append(q.shape)
        return q

    try:
        x = torch.zeros(1, 2, 2, 4)
        assert attention(x, x, x, "test_three_args") is x and calls == [x.shape]
    finally:
        del registry._BACKENDS["test_three_args"]


def test_one_query_gqa_decode_folds_heads_and_matches_the_repeated_heads():
    """A decode call (one query a row, a per-row mask, grouped K/V heads) folds each group's query
    heads into query positions of its K/V head instead of repeating K/V; the long-context,
    few-rows variant (two matmuls) gives the same attention."""
    from omniloop.models.layers.attention import _decode_gqa, _one_query_mask, few_rows_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 1, 8, 16, generator=g), torch.randn(3, 37, 2, 16, generator=g), torch.randn(3, 37, 2, 16, generator=g)
    mask = torch.rand(3, 1, 1, 37, generator=g) > 0.4
    mask[..., 0] = True  # every row sees a key
    k_rep, v_rep = k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * 16 ** -0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v_rep)
    assert _one_query_mask(q, mask) and not _one_query_mask(q, mask.expand(3, 8, 1, 37))
    out = attention(q, k, v, "sdpa", mask=mask)  # takes the fold
    assert torch.allclose(out, _decode_gqa(q, k, v, mask)) and torch.allclose(out, ref, atol=1e-6)  # measured 2.4e-7
    qg = q.reshape(3, 2, 4, 16)
    few = few_rows_attention(qg, k.transpose(1, 2), v.transpose(1, 2), mask).reshape(3, 1, 8, 16)
    assert torch.allclose(few, ref, atol=1e-6)
