"""GPU only (never in CI): Qwen2's decode replayed from CUDA graphs (``cuda_graphs=True``) gives
the eager engine's tokens for 1 and 3 batched greedy requests, with captures and replays and no
failed capture (the CPU route of the same path: test_paged_decode.py)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import text_request

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_decode_tokens_equal_eager(qwen2_dir, batch):
    tokens = {}
    for graphs in (False, True):
        options = LoadOptions(device=torch.device("cuda"), dtype=torch.float32, cuda_graphs=graphs)
        _, pipeline = load_pipeline(qwen2_dir, options)
        engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=batch, max_running=batch)))
        for i in range(batch):
            engine.add_request(text_request(PROMPTS[i] * 2, max_tokens=32).model_copy(update={"request_id": f"r{i}"}))
        done = {}
        with torch.inference_mode():
            while engine.has_unfinished():
                for o in engine.step():
                    done[o.request_id] = o.text.token_ids
        tokens[graphs] = done
        if graphs:
            summary = pipeline.caches["cuda_graphs"].summary()
            assert summary["captures"] >= 1 and summary["replays"] > 0 and summary["capture_failures"] == 0, summary
    assert tokens[True] == tokens[False]
