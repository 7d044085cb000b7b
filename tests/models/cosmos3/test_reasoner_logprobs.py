"""Token log-probs of the Cosmos3 reasoner (the AR loop on the resident transformer) ==
``log_softmax`` of transformers' ``Cosmos3OmniForConditionalGeneration`` logits over the same
chat prompt + greedy output (the unified checkpoint of test_reasoner_parity)."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine
from omniloop.request import OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.cosmos3.checkpoint import save_unified

transformers = pytest.importorskip("transformers")
PROMPT = "a robot arm picks up a cube"
TOL = 2e-5


@pytest.fixture(scope="module")
def reference(cosmos3_dir, tmp_path_factory):
    unified = save_unified(cosmos3_dir, tmp_path_factory.mktemp("cosmos3_unified_lp"), vision=True)
    model = transformers.Cosmos3OmniForConditionalGeneration.from_pretrained(unified, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(unified)


def test_reasoner_token_logprobs_equal_transformers(cosmos3_pipeline, reference):
    engine = Engine(cosmos3_pipeline)
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=PROMPT)],
                                         sampling=SamplingParams(max_tokens=8, temperature=0.0),
                                         outputs=OutputSpec(return_log_probs=True, top_logprobs=2)))
    with torch.inference_mode():
        text = engine.run_until_done(rid).text
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    full = torch.cat([ids, torch.tensor([text.token_ids])], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=full).logits[0, ids.shape[1] - 1: -1].float(), dim=-1)  # [T, V]
    expected = logp.gather(1, torch.tensor(text.token_ids)[:, None])[:, 0]
    ours = torch.tensor([t.logprob for t in text.log_probs])
    assert [t.token_id for t in text.log_probs] == text.token_ids
    assert (ours - expected).abs().max() <= TOL
    values, top = torch.topk(logp, 2)
    assert [[a.token_id for a in t.top] for t in text.log_probs] == top.tolist()
    assert max(abs(a.logprob - v) for t, vs in zip(text.log_probs, values.tolist()) for a, v in zip(t.top, vs)) <= TOL
