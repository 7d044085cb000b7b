"""GPU only (never in CI): the Qwen2.5-Omni and Qwen3-Omni thinker and talker decode steps
replayed from CUDA graphs (``cuda_graphs=True``; Qwen3-Omni's MoE layers in their static
dispatch) give the eager engine's text and speech, at batch 1 and 3 (bucket 4). The same
bucketed path run eager on the CPU: tests/models/qwen*_omni/test_graph_decode.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _answers(folder, requests, graphs: bool) -> tuple[dict, dict]:
    """Request index -> (text ids, audio samples), and the runner's summary."""
    from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cuda"), dtype=torch.float32, cuda_graphs=graphs,
                                                    kv_cache_gb=0.05))
    n = len(requests)
    engine = Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=n, max_running=n)))
    ids = [engine.add_request(request) for request in requests]  # added together: their steps batch
    done = {}
    for i, rid in enumerate(ids):
        engine.run_until_done(rid)
        out = engine.pop_output(rid)
        assert out.status.value == "completed", out.error
        done[i] = (out.text.token_ids, out.audio.samples.cpu())
    return done, (pipeline.caches["cuda_graphs"].summary() if graphs else {})


def _requests(family: str, batch: int) -> list:
    if family == "qwen2_5_omni":
        from tests.models.qwen2_5_omni.checkpoint import PROMPTS
        from tests.models.qwen2_5_omni.helpers import omni_request as make
    else:
        from tests.models.qwen3_omni.checkpoint import PROMPTS
        from tests.models.qwen3_omni.helpers import omni3_request as make
    return [make(PROMPTS[i % len(PROMPTS)], seed=i) for i in range(batch)]


def _checkpoint(family: str, folder) -> None:
    if family == "qwen2_5_omni":
        from tests.models.qwen2_5_omni.checkpoint import save_omni_checkpoint
        save_omni_checkpoint(folder, seed=0)
    else:
        from tests.models.qwen3_omni.checkpoint import save_omni3_checkpoint
        save_omni3_checkpoint(folder, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
@pytest.mark.parametrize("batch", [1, 3])
def test_omni_graph_decode_equals_eager(family, batch, tmp_path):
    _checkpoint(family, tmp_path)
    eager, _ = _answers(tmp_path, _requests(family, batch), graphs=False)
    replayed, summary = _answers(tmp_path, _requests(family, batch), graphs=True)
    assert summary["captures"] >= 2 and summary["replays"] > 0 and summary["capture_failures"] == 0, summary
    assert len(eager) == batch and eager.keys() == replayed.keys()
    for rid, (text, audio) in eager.items():  # rid: the request's index
        got_text, got_audio = replayed[rid]
        assert got_text == text, rid
        # the same codes make the same speech (up to the vocoder's kernels on two runs)
        assert got_audio.shape == audio.shape and (got_audio - audio).abs().max().item() <= 1e-4, rid
