"""The bucketed decode forward of the CUDA-graph path (pipeline/loops/ar_graphs.py), run eager
on the CPU (the runner routes CPU calls to the forward itself): padding the batch and the
contexts to buckets gives the eager PagedKVBatch path's tokens, logits within 1e-5, across a
blocks-per-row bucket boundary. The graph replay itself is tests/pipeline/test_ar_graphs_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniloop.cache.paged_kv import BlockPool, PagedKVBatch
from omniloop.models.families.cosmos3.model import Cosmos3Config, Cosmos3Reasoner, Cosmos3Transformer
from omniloop.models.families.cosmos3 import presets as P
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.pipeline.loops.ar_graphs import graph_decode, graph_rows

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, rope_axes_dim=[2, 1, 1], vocab_size=97)


def _reasoner():
    torch.manual_seed(0)
    config = Cosmos3Config.from_diffusers_config({**P.COSMOS3_TRANSFORMER, **TINY})
    model = Cosmos3Transformer(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return Cosmos3Reasoner(model)


def _qwen2():
    """A tiny Qwen2 (GQA, biased QKV): the family whose spec passes the runner to its decode loop."""
    from omniloop.models.families.qwen2.model import Qwen2Config, Qwen2LM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2LM(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _prefilled(lm, pool, prompts):
    handles = []
    for ids in prompts:
        h = pool.handle()
        assert h.reserve(len(ids))
        lm(torch.tensor([ids]), kv=PagedKVBatch([h], len(ids)), logits_to_keep=1)
        handles.append(h)
    return handles


@torch.inference_mode()
@pytest.mark.parametrize("make_lm", [_reasoner, _qwen2], ids=["cosmos3_reasoner", "qwen2"])
def test_bucketed_decode_equals_the_eager_paged_step(make_lm):
    lm = make_lm()
    layout = lm.kv_layout
    pools = [BlockPool(layout, dtype=torch.float32, device="cpu", block_size=4,
                       budget_bytes=64 * 4 * layout.bytes_per_token(torch.float32)) for _ in range(2)]
    prompts = [list(range(3, 3 + n)) for n in (29, 6, 17)]  # row 0 crosses 8 blocks (32 tokens) at step 3
    eager, padded = (_prefilled(lm, pool, prompts) for pool in pools)
    runner = CudaGraphRunner()
    last = [[5], [6], [7]]
    worst = 0.0
    for step in range(6):
        for h in eager + padded:
            assert h.reserve(h.num_tokens + 1)
        ref = lm(torch.tensor(last), kv=PagedKVBatch(eager, 1), logits_to_keep=1)[:, -1].float()
        loops = [SimpleNamespace(kv=h, output_ids=ids, lm_inputs=None) for h, ids in zip(padded, last)]
        got = graph_decode(runner, lm, loops)  # 3 rows -> bucket 4 (one pad row)
        assert got.shape == ref.shape
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        worst = max(worst, (got - ref).abs().max().item())
        assert [h.num_tokens for h in padded] == [h.num_tokens for h in eager]
        last = [[t] for t in ref.argmax(-1).tolist()]
    print("max |graph path - eager| logits:", worst)
    assert worst < 1e-5, worst  # masked vs unmasked kernel, padded context
    assert runner.stats.eager_not_cuda == 6 and runner.stats.captures == 0
    assert not graph_rows(runner, lm, loops)  # a CPU pool never takes the graph path in the loop


def test_cuda_graphs_are_refused_on_a_cpu_deployment(tmp_path):
    from omniloop.models.load_options import graph_runner
    from omniloop.models.model_spec import LoadOptions

    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device.*cuda_graphs=False"):
        graph_runner(LoadOptions(device=torch.device("cpu"), dtype=torch.float32, cuda_graphs=True))
    assert graph_runner(LoadOptions(device=torch.device("cpu"), dtype=torch.float32)) is None


def test_graph_rows_takes_per_request_rows_only_from_a_graph_step_lm(monkeypatch):
    """A plain LM's rows with per-request inputs (an image prompt) stay eager; text rows up to
    the largest bucket take the graph path (the omni LMs' rows: tests/models/qwen*_omni/test_graph_decode.py)."""
    from omniloop.pipeline.loops import ar_graphs

    lm = _reasoner()
    pool = BlockPool(lm.kv_layout, dtype=torch.float32, device="cpu", block_size=4,
                     budget_bytes=16 * 4 * lm.kv_layout.bytes_per_token(torch.float32))
    runner, h = CudaGraphRunner(), pool.handle()
    text = SimpleNamespace(kv=h, output_ids=[1], lm_inputs=None)
    image = SimpleNamespace(kv=h, output_ids=[1], lm_inputs=object())
    assert not graph_rows(runner, lm, [text])  # a CPU pool
    monkeypatch.setattr(ar_graphs, "GRAPH_DEVICES", frozenset({"cpu"}))
    assert not isinstance(lm, ar_graphs.GraphStepLM)
    assert graph_rows(runner, lm, [text] * 32) and not graph_rows(runner, lm, [text] * 33)
    assert not graph_rows(runner, lm, [text, image]) and not graph_rows(None, lm, [text])
