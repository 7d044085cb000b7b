"""The omni thinker's and talker's bucketed decode (pipeline/loops/ar_graphs.py, the CUDA-graph
path) against the eager ``PagedKVBatch`` step, run eager on the CPU (the runner routes a CPU call
to the forward itself): three rows padded to the 4-row bucket, one of them crossing the 8-block
bucket (32 keys at 4 tokens a block) after a few steps. What both families' tests share."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from omniloop.cache.paged_kv import BlockPool, PagedKVBatch
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.omni.image_prompt import VisionRun, rope_positions
from omniloop.models.omni.media import MediaEmbeds, PromptRope
from omniloop.models.omni.thinker import ThinkerRow
from omniloop.pipeline.loops import ar_graphs
from omniloop.pipeline.loops.ar_graphs import graph_decode
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.state import RequestState
from omniloop.request import OmniRequest
from tests.models.qwen2_5_omni.helpers import run_nodes

PROMPT_LENS = (29, 6, 17)  # row 0 crosses 8 blocks of 4 (32 keys) at its 4th step
STEPS = 6
AR_NODES = ("chat", "thinker", "talker")  # what a spoken answer's check runs (the codes: the talker's)
IMAGE_TOKEN = 7  # the image run's placeholder id in these prompts (any id: the embeddings replace it)


def image_prompt(length: int, text_ids: Sequence[int]) -> tuple[list[int], PromptRope]:
    """``length`` ids: 5 text, one 8x8-patch image (16 placeholders at merge 2), text after; and
    its 3-D rotary positions (``rope_positions``: the image's h/w grid, delta < 0 after it)."""
    ids = list(text_ids[:5]) + [IMAGE_TOKEN] * 16 + list(text_ids[5:length - 16])
    assert len(ids) == length
    planes, delta = rope_positions(ids, [VisionRun(token=IMAGE_TOKEN, grid=(1, 8, 8))], merge=2)
    return ids, PromptRope(planes, delta)


def thinker_rows(width: int, seed: int) -> tuple[list[list[int]], list[ThinkerRow | None]]:
    """The thinker's three prompts: an image (3-D positions, its states recorded: a spoken
    answer), text only (no per-request inputs), audio (1-D, its placeholders' embeddings, recorded)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(10, 90, (max(PROMPT_LENS),), generator=g).tolist()
    ids0, rope = image_prompt(PROMPT_LENS[0], text)
    index0 = torch.tensor([i - 5 if 5 <= i < 21 else -1 for i in range(PROMPT_LENS[0])])
    image = MediaEmbeds(index=index0, embeds=torch.randn(16, width, generator=g), positions=rope.positions,
                        delta=rope.delta)
    index2 = torch.tensor([i - 3 if 3 <= i < 11 else -1 for i in range(PROMPT_LENS[2])])
    audio = MediaEmbeds(index=index2, embeds=torch.randn(8, width, generator=g))
    prompts = [ids0, text[:PROMPT_LENS[1]], text[:PROMPT_LENS[2]]]
    return prompts, [ThinkerRow(media=image), None, ThinkerRow(media=audio)]


def talker_rope() -> PromptRope:
    """A talker prompt's 3-D positions: the conversation held an image."""
    return image_prompt(PROMPT_LENS[0], list(range(10, 10 + PROMPT_LENS[0])))[1]


def check_bucketed_decode(lm: Any, vocab: int, make_rows: Callable[[], tuple[list[list[int]], list[Any]]],
                          compare_rows: Callable[[Any, Any], float] | None = None) -> float:
    """Prefill the prompts of ``make_rows()`` into two pools (each run its own rows), then
    :data:`STEPS` decode steps: the eager paged step and :func:`graph_decode` (3 rows, bucket 4)
    feed the same tokens; the tokens must be equal, the KV lengths too; ``compare_rows(eager,
    graph)`` the rows' per-request records (the worst difference). -> the worst logit difference."""
    layout = lm.kv_layout
    budget = 64 * 4 * layout.bytes_per_token(torch.float32)
    runs = []
    for _ in range(2):
        pool = BlockPool(layout, dtype=torch.float32, device="cpu", block_size=4, budget_bytes=budget)
        prompts, rows = make_rows()
        handles = []
        for ids, row in zip(prompts, rows):
            h = pool.handle()
            assert h.reserve(len(ids))
            lm(torch.tensor([ids]), kv=PagedKVBatch([h], len(ids)), logits_to_keep=1,
               **({"lm_inputs": [row]} if row is not None else {}))
            handles.append(h)
        runs.append((handles, rows))
    (eager, eager_rows), (padded, padded_rows) = runs
    runner = CudaGraphRunner()
    last = [[int(t)] for t in torch.randint(1, vocab, (len(eager),), generator=torch.Generator().manual_seed(3))]
    worst = worst_rows = 0.0
    for _ in range(STEPS):
        for h in eager + padded:
            assert h.reserve(h.num_tokens + 1)
        ref = lm(torch.tensor(last), kv=PagedKVBatch(eager, 1), logits_to_keep=1, lm_inputs=eager_rows)[:, -1].float()
        loops = [SimpleNamespace(kv=h, output_ids=ids, lm_inputs=row) for h, ids, row in zip(padded, last, padded_rows)]
        got = graph_decode(runner, lm, loops)  # 3 rows -> bucket 4 (one pad row)
        assert got is not None and got.shape == ref.shape
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        finite = torch.isfinite(ref)  # a talker's suppressed ids are -inf on both paths
        assert torch.equal(finite, torch.isfinite(got))
        worst = max(worst, (got - ref)[finite].abs().max().item())
        assert [h.num_tokens for h in padded] == [h.num_tokens for h in eager]
        if compare_rows is not None:
            worst_rows = max([worst_rows] + [compare_rows(a, b) for a, b in zip(eager_rows, padded_rows)])
        last = [[t] for t in ref.argmax(-1).tolist()]
    assert max(len(h.block_table) for h in padded) > 8, "no row crossed the 8-block bucket"
    assert runner.stats.eager_not_cuda == STEPS and runner.stats.captures == 0
    print(f"max |graph path - eager|: logits {worst:.3g}, recorded rows {worst_rows:.3g}")
    return max(worst, worst_rows)


def compare_thinker_rows(eager: ThinkerRow | None, graph: ThinkerRow | None) -> float:
    """The recorded states of every forwarded position (prefill and decode) agree."""
    if eager is None:
        assert graph is None
        return 0.0
    assert graph is not None and eager.filled == graph.filled
    return (eager.states() - graph.states()).abs().max().item()


def run_nodes_on_graph_path(pipeline: Pipeline, request: OmniRequest, monkeypatch: Any) -> tuple[RequestState, CudaGraphRunner]:
    """``run_nodes`` with a runner on the thinker and talker nodes and the CPU let onto the
    graph path (its runner runs each bucketed step eager): the loops' wiring of it (the
    recorded states streamed to the talker, the talker's inputs) -> the state and the runner."""
    runner = CudaGraphRunner()
    monkeypatch.setattr(ar_graphs, "GRAPH_DEVICES", frozenset({"cuda", "cpu"}))
    for name in ("thinker", "talker"):
        monkeypatch.setattr(pipeline.spec.node(name).stage, "graphs", runner)
    return run_nodes(pipeline, request, only=AR_NODES), runner


def check_same_answer(eager: RequestState, graph: RequestState, runner: CudaGraphRunner, codes: str) -> None:
    """The text, the speech's codes (the codec artifact's ``codes`` field) and the thinker's
    states agree, and the decode steps went through the runner."""
    assert graph.artifacts["text"].token_ids == eager.artifacts["text"].token_ids
    assert getattr(graph.artifacts["codec"], codes) == getattr(eager.artifacts["codec"], codes)
    a, b = eager.artifacts["thinker_states"].hidden, graph.artifacts["thinker_states"].hidden
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5
    # at least the decode forwards of both loops (each forwards its tokens but the last; a codec
    # artifact may leave the end code out)
    forwards = len(eager.artifacts["text"].token_ids) - 1 + len(getattr(eager.artifacts["codec"], codes)) - 1
    assert runner.stats.eager_not_cuda >= forwards > 0, (runner.summary(), forwards)
