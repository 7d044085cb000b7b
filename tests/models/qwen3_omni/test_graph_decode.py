"""Qwen3-Omni's MoE thinker and talker decode steps on the CUDA-graph path (pipeline/loops/
ar_graphs.py: MoE layers in their static dispatch, the talker's code predictor run eager before
the captured part), run eager on the CPU: padded to the batch and blocks buckets they give the
eager step's tokens, logits within 1e-5, the same recorded thinker states, the same frames and
last hidden states of the talker (the capture and replay: tests/pipeline/test_ar_graphs_omni_gpu.py)."""

from __future__ import annotations

import functools

import torch

from omniloop.models.families.qwen3_omni.model import PredictorSampling, TalkerRow
from omniloop.models.layers.moe import static_dispatch
from tests.models import omni_graph_steps as steps
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.qwen3_omni.helpers import omni3_request
from tests.models.qwen3_omni.checkpoint import CODEBOOK, PROMPTS

TOLERANCE = 1e-5  # fp32, the masked kernel over the padded context and every expert's matmul over all rows


@torch.inference_mode()
def test_moe_static_dispatch_equals_the_sparse_loop(omni3_pipeline):
    """Every expert over every token, the unrouted dropped = the hit experts over their tokens."""
    moe = omni3_pipeline.components["talker"].model.layers[0].mlp  # the talker's: with a shared expert
    x = torch.randn(7, moe.dims.hidden_size, generator=torch.Generator().manual_seed(0))
    with static_dispatch():
        dense = moe(x)
    diff = (dense - moe(x)).abs().max().item()
    print("static vs sparse dispatch:", diff)
    assert diff < 1e-6


@torch.inference_mode()
def test_thinker_bucketed_decode_equals_eager(omni3_pipeline):
    """An image prompt (3-D positions), a text-only row and an audio prompt in one batch; the
    recorded states are those after ``accept_hidden_layer`` layers."""
    lm = omni3_pipeline.components["thinker"]
    rows = functools.partial(steps.thinker_rows, lm.config.hidden_size, seed=1)
    assert steps.check_bucketed_decode(lm, lm.config.vocab_size, rows, steps.compare_thinker_rows) < TOLERANCE


@torch.inference_mode()
def test_talker_bucketed_decode_equals_eager(omni3_pipeline):
    """Each step: the code predictor's residual codes of the new frame (eager, greedy), then the
    frame's summed codebook embeddings + its text row (``tts_pad`` once they run out) replayed."""
    lm = omni3_pipeline.components["talker"]
    width = lm.config.hidden_size

    def rows():
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, CODEBOOK, (n,), generator=g).tolist() for n in steps.PROMPT_LENS]
        made = [TalkerRow(prompt_embeds=torch.randn(n, width, generator=g), trailing=torch.randn(3, width, generator=g),
                          pad=torch.randn(width, generator=g), sampling=PredictorSampling(greedy=True),
                          rope=steps.talker_rope() if i == 0 else None) for i, n in enumerate(steps.PROMPT_LENS)]
        return prompts, made

    def compare(eager: TalkerRow, graph: TalkerRow) -> float:
        assert eager.frames == graph.frames and eager.last_hidden is not None and graph.last_hidden is not None
        return (eager.last_hidden - graph.last_hidden).abs().max().item()

    assert steps.check_bucketed_decode(lm, CODEBOOK, rows, compare) < TOLERANCE


def test_spoken_answer_on_the_graph_path(monkeypatch, omni3_pipeline):
    """The thinker and talker loops with a runner (the CPU let onto the graph path): the same
    text, speech and thinker states as without one."""
    eager = run_nodes(omni3_pipeline, omni3_request(PROMPTS[1]), only=steps.AR_NODES)
    graph, runner = steps.run_nodes_on_graph_path(omni3_pipeline, omni3_request(PROMPTS[1]), monkeypatch)
    steps.check_same_answer(eager, graph, runner, "frames")
