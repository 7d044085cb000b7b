"""GPU only (never in CI): the Cosmos3 reasoner's decode replayed from CUDA graphs gives the
eager engine's tokens, at batch 1 and 3 (bucket 4), across a blocks-per-row bucket."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,words", [(1, 20), (3, 20), (1, 800)])
def test_graph_decode_tokens_equal_eager(batch, words):
    """words=800: a ~2,100-token context (a 4,096-key bucket), where the graph's attention takes
    the few-rows matmul path (``attention.few_rows_attention``)."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_cosmos3 as B
    from omniloop.engine import Engine, EngineConfig, SchedulingPolicy

    device = torch.device("cuda")
    outs = {}
    for graphs in (False, True):
        args = argparse.Namespace(tiny=True, kv_cache_gb=0.05, cuda_graphs=graphs)
        pipeline = B.build(args, device, torch.float32)
        engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=batch, max_running=batch)))
        for i in range(batch):
            engine.add_request(B.chat(f"r{i}", words + 7 * i, 40))  # ~100-130 tokens: crosses 8 blocks (128)
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                done[o.request_id] = o.artifacts["text"].token_ids
        outs[graphs] = done
        if graphs:
            summary = pipeline.caches["cuda_graphs"].summary()
            assert summary["captures"] >= 1 and summary["replays"] > 0 and summary["capture_failures"] == 0, summary
    assert outs[True] == outs[False]
