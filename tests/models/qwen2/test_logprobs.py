"""Token log-probs of the AR loop vs transformers: each generated token's log-prob and the top-k
at its position equal ``log_softmax`` of ``Qwen2ForCausalLM``'s logits over the same prompt +
output (teacher-forced), for greedy and seeded sampled decoding, batched or alone, streamed."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig
from omniloop.engine.offline import run_request
from omniloop.request import OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.qwen2.checkpoint import PROMPTS

TOL = 2e-5  # fp32 logits differ by <= 2e-6 (test_parity); log_softmax over the vocab keeps it small


def _request(prompt: str, rid: str | None = None, top: int = 3, **sampling) -> OmniRequest:
    sampling = {"temperature": 0.0, "max_tokens": 12, **sampling}
    extra = {"request_id": rid} if rid else {}
    return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=prompt)], sampling=SamplingParams(**sampling),
                       outputs=OutputSpec(return_log_probs=True, top_logprobs=top), **extra)


@torch.inference_mode()
def _reference(hf, tokenizer, prompt: str, output_ids: list[int]) -> torch.Tensor:
    """transformers' next-token log-probs at each output position: [T, vocab]."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    full = torch.cat([ids, torch.tensor([output_ids])], dim=1)
    logits = hf(full).logits[0, ids.shape[1] - 1 : -1].float()  # the logits that chose each output token
    return torch.log_softmax(logits, dim=-1)


def _check(out, hf, tokenizer, prompt: str, top: int) -> None:
    text = out.text
    assert out.status.value == "completed", out.error
    assert [t.token_id for t in text.log_probs] == text.token_ids
    ref = _reference(hf, tokenizer, prompt, text.token_ids)
    ours = torch.tensor([t.logprob for t in text.log_probs])
    expected = ref.gather(1, torch.tensor(text.token_ids)[:, None])[:, 0]
    assert (ours - expected).abs().max() <= TOL
    for pos, entry in enumerate(text.log_probs):
        assert entry.token == tokenizer.decode([entry.token_id])
        values, ids = torch.topk(ref[pos], top)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(entry.top, values.tolist())) <= TOL


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}])
def test_token_logprobs_equal_transformers_log_softmax(qwen2_pipeline, qwen2_hf, sampling):
    hf, tokenizer = qwen2_hf
    for prompt in PROMPTS[:2]:
        _check(run_request(qwen2_pipeline, _request(prompt, **sampling)), hf, tokenizer, prompt, 3)


def test_batched_streamed_logprobs_equal_each_alone(qwen2_pipeline, qwen2_hf):
    hf, tokenizer = qwen2_hf
    events = []
    engine = Engine(qwen2_pipeline, EngineConfig(), event_sink=events.append)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(_request(prompt, rid=f"r{i}", top=2))
    outs = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
    for i, prompt in enumerate(PROMPTS[:3]):
        out = outs[f"r{i}"]
        _check(out, hf, tokenizer, prompt, 2)
        streamed = [t for e in events if e.request_id == f"r{i}" and getattr(e, "name", None) == "text_delta"
                    for t in e.artifact.log_probs]
        assert streamed == out.text.log_probs  # the deltas' log-probs concatenate to the final ones


def test_no_logprobs_unless_asked(qwen2_pipeline):
    out = run_request(qwen2_pipeline, OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=PROMPTS[0])],
                                                  sampling=SamplingParams(temperature=0.0, max_tokens=4)))
    assert out.text.log_probs is None
    out = run_request(qwen2_pipeline, _request(PROMPTS[0], top=0, max_tokens=4))
    assert len(out.text.log_probs) == 4 and all(t.top == () for t in out.text.log_probs)


def test_update_weights_from_a_transformers_state_dict(qwen2_dir, qwen2_hf):
    """AR RL's weight push: a perturbed ``Qwen2ForCausalLM`` state dict (transformers' names,
    fused into ours by the family's layout) -> the engine decodes what that model generates."""
    from transformers import Qwen2ForCausalLM

    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, tokenizer = qwen2_hf
    pipeline = load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    engine = Engine(pipeline, EngineConfig())
    policy = Qwen2ForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    info = engine.update_weights(policy.state_dict(), "1", component="lm")
    assert info.copied_tensors > 0
    rid = engine.add_request(_request(PROMPTS[1], top=0))
    with torch.inference_mode():
        out = engine.run_until_done(rid)
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        want = policy.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.weight_version == "1" and out.text.token_ids == want
