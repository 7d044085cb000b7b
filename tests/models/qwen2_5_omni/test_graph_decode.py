"""Qwen2.5-Omni's thinker and talker decode steps on the CUDA-graph path (pipeline/loops/
ar_graphs.py), run eager on the CPU: padded to the batch and blocks buckets they give the eager
step's tokens, logits within 1e-5 and the same recorded thinker states (the capture and replay:
tests/pipeline/test_ar_graphs_omni_gpu.py)."""

from __future__ import annotations

import functools

import torch

from omniloop.models.families.qwen2_5_omni.model import TalkerRow
from tests.models import omni_graph_steps as steps
from tests.models.qwen2_5_omni.checkpoint import PROMPTS
from tests.models.qwen2_5_omni.helpers import omni_request, run_nodes

TOLERANCE = 1e-5  # fp32, the masked kernel over the padded context vs the eager step


@torch.inference_mode()
def test_thinker_bucketed_decode_equals_eager(omni_pipeline):
    """An image prompt (3-D positions), a text-only row and an audio prompt in one batch."""
    lm = omni_pipeline.components["thinker"]
    rows = functools.partial(steps.thinker_rows, lm.config.hidden_size, seed=1)
    assert steps.check_bucketed_decode(lm, lm.config.vocab_size, rows, steps.compare_thinker_rows) < TOLERANCE


@torch.inference_mode()
def test_talker_bucketed_decode_equals_eager(omni_pipeline):
    """Every step's input: the code's embedding + the thinker's reply row (the last one repeated
    once they run out); row 0's prompt held an image (3-D positions)."""
    lm = omni_pipeline.components["talker"]
    width = lm.config.embedding_size

    def rows():
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, lm.config.vocab_size, (n,), generator=g).tolist() for n in steps.PROMPT_LENS]
        made = [TalkerRow(prompt_embeds=torch.randn(n, width, generator=g), reply=torch.randn(4, width, generator=g),
                          rope=steps.talker_rope() if i == 0 else None) for i, n in enumerate(steps.PROMPT_LENS)]
        return prompts, made

    assert steps.check_bucketed_decode(lm, lm.config.vocab_size, rows) < TOLERANCE


def test_spoken_answer_on_the_graph_path(monkeypatch, omni_pipeline):
    """The thinker and talker loops with a runner (the CPU let onto the graph path): the same
    text, speech and thinker states as without one."""
    eager = run_nodes(omni_pipeline, omni_request(PROMPTS[1]), only=steps.AR_NODES)
    graph, runner = steps.run_nodes_on_graph_path(omni_pipeline, omni_request(PROMPTS[1]), monkeypatch)
    steps.check_same_answer(eager, graph, runner, "codes")
