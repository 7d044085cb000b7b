"""Qwen2 tensor-parallel from outside (models/families/qwen2/parallelize.py) on 2 gloo ranks
equals one process.

The LM alone (a cache-less forward, GQA with 4 query and 2 key/value heads: the fused q|k|v
splits into unequal parts): logits within float32 reassociation of the all-reduced partial
sums (measured max |diff| 3.0e-7; TOL 2e-6). Through the pool (paged KV rebuilt
per rank for one kv head, prefill + decode): the greedy tokens and the seeded sampled tokens
are the one-process ones. sp, dp and cfg are refused, each naming why and that tp works."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.parallel.spec import ParallelSpec
from tests.models.qwen2.helpers import text_request
from tests.parallel.ranks import rank_threads, run_ranks, threads

TOL = 2e-6


def _model():
    from omniloop.models.families.qwen2.model import Qwen2Config, Qwen2LM

    torch.manual_seed(0)
    return Qwen2LM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()


def _ids():
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def _tp_logits(rank, world):
    from omniloop.models.families.qwen2.parallelize import QWEN2_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh

    model = _model()
    parallelize_model(model, QWEN2_PARALLEL, ParallelMesh.build(ParallelSpec(tp=world), torch.device("cpu")))
    assert model.layers[0].self_attn.num_kv_heads == 1 and model.layers[0].mlp.intermediate_size == 32
    with torch.inference_mode():
        return model(_ids())


def test_qwen2_lm_tp_on_two_ranks_equals_one_process():
    results = run_ranks(_tp_logits, 2)
    model = _model()
    with torch.inference_mode(), threads(rank_threads(2)):
        reference = model(_ids())
    errors = [(got - reference).abs().max().item() for got in results]
    assert 0 < max(errors) <= TOL, errors  # the partial sums really were all-reduced
    assert torch.equal(results[0], results[1])  # every rank samples from the same logits


REQUESTS = ((dict(max_tokens=12)), dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=5))


def test_qwen2_tp_through_the_pool_decodes_the_one_process_tokens(qwen2_dir):
    one = VideoGenerator.from_pretrained(qwen2_dir, device="cpu", dtype="float32")
    with torch.inference_mode(), threads(rank_threads(2)):
        expected = [one.generate(text_request("the red circle", **s)).artifacts["text"].token_ids for s in REQUESTS]
    with VideoGenerator.from_pretrained(qwen2_dir, device="cpu", dtype="float32", parallel="tp=2") as gen:
        kv = gen.pipeline.components["text_kv"]
        assert kv.layout.num_kv_heads == 1 and kv.num_blocks == one.pipeline.components["text_kv"].num_blocks
        got = [gen.generate(text_request("the red circle", **s)).artifacts["text"].token_ids for s in REQUESTS]
    assert got == expected


def test_qwen2_preflight_refuses_sp_dp_cfg_naming_tp(qwen2_dir):
    facts = model_facts(qwen2_dir)
    assert facts.family == "qwen2" and dict(facts.heads) == {"lm": 2}
    check_model(ParallelSpec.from_flag("tp=2"), facts)
    for flag, reason in (("sp=2", r"sp=2: an AR decode step runs one new token per request"),
                         ("cfg=2", r"dp x cfg = 2: the AR decode loop does not split .* no guidance branches"),
                         ("dp=2", r"dp x cfg = 2: the AR decode loop")):
        with pytest.raises(ValueError, match=reason + r".*tp splits Qwen2.*A spec that works for this model: "
                                                      r"parallel='dp=1'"):
            check_model(ParallelSpec.from_flag(flag), facts)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 attention heads of 'lm'.*parallel='dp=1'"):
        check_model(ParallelSpec.from_flag("tp=4"), facts)
